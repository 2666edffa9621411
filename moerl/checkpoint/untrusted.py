"""What is read from storage is untrusted (docs/checkpoints.md, "What is trusted"): object keys, manifests and
pickles may be forged. The checks every reader of a checkpoint shares:

    check_key(key, where)        a key is a plain relative path, or CheckpointError naming it
    shown_key(key)               a key as a message shows it: one line, escaped, cut short
    inside(base, key, where)     the local path of `key` under `base`, never outside it (symlinks resolved)
    load_error(e)                one line for a refused torch.load, never advice to load it unsafely
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from moerl.model.config import CheckpointError

NAME_MAX = 255  # bytes of one path component (Linux, macOS)
MAX_KEY_BYTES = 1024  # bytes of an S3 key
# Unicode categories refused in a key: control (C0, DEL, C1), format (bidi overrides, zero-width), line and
# paragraph separators, surrogates, private use and unassigned.
_UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})

_GLOBAL = re.compile(r"Unsupported global: GLOBAL \S+")


def check_key(key: object, where: str) -> str:
    """`key` when it is a plain relative path: '/'-separated parts, none empty (no `//`, no leading `/`), `.` or
    `..`; no backslash, colon (a URL scheme, a drive), control, format or separator character (a right-to-left
    override or U+2028 would reorder or split the line that prints it); each part at most NAME_MAX bytes and the
    whole at most MAX_KEY_BYTES (S3's limit: a longer one ends a local write with ENAMETOOLONG). On S3 a key is any
    string, and joined onto a local directory `hf//abs/path` is `/abs/path` and `hf/../../x` climbs out."""
    if not isinstance(key, str) or not key:
        raise CheckpointError(f"{where}: object key {key!r} is not a plain relative path inside the checkpoint "
                              "(refused: a checkpoint is untrusted input)")
    shown = shown_key(key)
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES or any(
            len(p.encode("utf-8", "surrogatepass")) > NAME_MAX for p in key.split("/")):
        raise CheckpointError(f"{where}: object key {shown} is longer than a file name may be ({NAME_MAX} bytes a "
                              f"part, {MAX_KEY_BYTES} in all): refused, a checkpoint is untrusted input")
    if (key.startswith("~") or "\\" in key or ":" in key or any(unicodedata.category(c) in _UNPRINTABLE for c in key)
            or any(p in ("", ".", "..") for p in key.split("/"))):
        raise CheckpointError(f"{where}: object key {shown} is not a plain relative path inside the checkpoint "
                              "(refused: a checkpoint is untrusted input)")
    return key


def shown_key(key: str) -> str:
    """`key` as a message shows it: repr (every control, format and separator character escaped, so it stays one
    line and in order), cut to 200 characters with its length said."""
    return repr(key) if len(key) <= 200 else f"{key[:200]!r}... ({len(key)} characters)"


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
