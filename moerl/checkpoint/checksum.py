"""Per-file checksums of a checkpoint, computed from the bytes as they are written.

CRC-32 (zlib), written "crc32:<8 hex digits>". The threat is corruption (a flipped bit in storage or in
transit), not forgery: whoever can rewrite a tensor file can rewrite the COMMIT manifest too, so a
cryptographic hash would add nothing without signing the manifest. CRC-32 catches every burst of up to 32 bits
and misses random damage with probability 2**-32, runs ~5x faster than blake2b here (2.8 vs 0.6 GB/s on one
core), and zlib releases the GIL on large buffers, so DCP's writer threads hash in parallel.
"""

from __future__ import annotations

import zlib
from typing import Any

PREFIX = "crc32:"


def fmt(crc: int) -> str:
    return f"{PREFIX}{crc & 0xFFFFFFFF:08x}"


def checksum(data: bytes | bytearray | memoryview) -> str:
    return fmt(zlib.crc32(data))


class HashingStream:
    """A write stream that forwards everything to `raw` and hashes each byte `raw` accepted. DCP's writer
    calls write, tell, flush, close and fileno; all but write pass straight through."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.crc = 0

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view if n is None else view[:n], self.crc)  # a short write hashes what it wrote
        return n

    def hexdigest(self) -> str:
        return fmt(self.crc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)
