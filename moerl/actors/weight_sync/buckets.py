"""Buckets: a rank's published tensors laid end to end in flat byte buffers, the unit every transport moves.

A `Layout` is computed once per run from the tensors' names, dtypes and shapes (no data), so a buffer can be
allocated once and refilled every version, and a receiver can allocate its own copy before any byte arrives.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

Published = list[tuple[str, torch.Tensor, int | None]]  # (name, tensor, expert offset or None for a whole tensor)
_ALIGN = 64  # byte alignment of each tensor in a bucket (any dtype's view of it is aligned)


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    start: int  # byte offset in the bucket
    offset: int | None  # where an expert slice lands in the worker's expert dimension; None: a whole tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]
    nbytes: int


def plan(items: Iterable[tuple[str, torch.dtype, tuple[int, ...], int | None]], bucket_bytes: int) -> list[Layout]:
    """Split (name, dtype, shape, expert offset) into buckets of about `bucket_bytes` (a tensor never straddles two)."""
    layouts, entries, start = [], [], 0
    for name, dtype, shape, offset in items:
        entry = Entry(name, str(dtype).removeprefix("torch."), tuple(int(s) for s in shape), start, offset)
        entries.append(entry)
        start += -(-entry.nbytes // _ALIGN) * _ALIGN
        if start >= bucket_bytes:
            layouts.append(Layout(tuple(entries), start))
            entries, start = [], 0
    if entries:
        layouts.append(Layout(tuple(entries), start))
    return layouts


def views(flat_u8: torch.Tensor, layout: Layout) -> Published:
    """Typed views of a bucket's buffer (no copy), in layout order."""
    out: Published = []
    for e in layout.entries:
        out.append((e.name, flat_u8[e.start: e.start + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape), e.offset))
    return out


@dataclass
class Bucket:
    """One bucket as the object store carries it: its layout and a numpy byte buffer (stored and handed back
    zero-copy by Ray, never pickled tensor by tensor)."""

    layout: Layout
    data: np.ndarray  # uint8


def pack_bucket(items: Published) -> Bucket:
    """One bucket of these tensors (a copy each), for tests and small publishes."""
    (layout,) = plan([(n, t.dtype, tuple(t.shape), o) for n, t, o in items], bucket_bytes=1 << 62)
    data = np.empty(layout.nbytes, dtype=np.uint8)
    for (_, view, _), (_, t, _) in zip(views(torch.from_numpy(data), layout), items):
        view.copy_(t.detach())
    return Bucket(layout, data)


def unpack_bucket(bucket: Bucket) -> Published:
    """Views of the bucket's buffer (no copy); read-only when the buffer came from the object store."""
    with warnings.catch_warnings():  # a read-only buffer: we only ever read from these views
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(bucket.data)
    return views(flat, bucket.layout)
