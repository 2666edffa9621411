"""What is read from storage is untrusted (docs/checkpoints.md, "What is trusted"): object keys, manifests and
pickles may be forged. The checks every reader of a checkpoint shares:

    check_key(key, where)        a key is a plain relative path, or CheckpointError naming it
    inside(base, key, where)     the local path of `key` under `base`, never outside it (symlinks resolved)
    load_error(e)                one line for a refused torch.load, never advice to load it unsafely
"""

from __future__ import annotations

import re
from pathlib import Path

from moerl.model.config import CheckpointError

_GLOBAL = re.compile(r"Unsupported global: GLOBAL \S+")


def check_key(key: object, where: str) -> str:
    """`key` when it is a plain relative path: '/'-separated parts, none empty (no `//`, no leading `/`), `.` or
    `..`; no backslash, colon (a URL scheme, a drive) or control character. On S3 a key is any string, and joined
    onto a local directory `hf//abs/path` is `/abs/path` and `hf/../../x` climbs out."""
    if (not isinstance(key, str) or not key or key.startswith("~") or "\\" in key or ":" in key
            or any(ord(c) < 32 or ord(c) == 127 for c in key) or any(p in ("", ".", "..") for p in key.split("/"))):
        raise CheckpointError(f"{where}: object key {key!r} is not a plain relative path inside the checkpoint "
                              "(refused: a checkpoint is untrusted input)")
    return key


def inside(base: Path, key: str, where: str) -> Path:
    """`base / key`, refused unless it resolves inside `base` (a symlink already in `base` must not lead out)."""
    path = base / check_key(key, where)
    if not path.resolve().is_relative_to(base.resolve()):
        raise CheckpointError(f"{where}: object key {key!r} leads outside {str(base)!r} (refused)")
    return path


def load_error(e: BaseException) -> str:
    """What went wrong reading an untrusted pickle, in one line. torch's own message for a refused weights-only
    load says to retry with weights_only=False, which would run whatever the file holds: never passed on."""
    text = str(e)
    if "Weights only load failed" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else ""
        line = next((s.strip() for s in detail.splitlines() if s.strip()), "")
        found = _GLOBAL.search(line)
        line = found.group(0) if found else line.split(". ")[0]
        return ("holds a pickle that is not plain tensor data" + (f" ({line})" if line else "")
                + ": refused, a checkpoint is untrusted input")
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else repr(e)}"
