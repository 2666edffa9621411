"""The controller's state as bytes: plain containers, numbers, strings, tensors and allowed dataclasses.

A checkpoint in a shared bucket must never execute code when a run resumes, so the bytes are read back only
with `torch.load(weights_only=True)`, which refuses any class but tensors and builtin containers. Dataclasses
therefore travel as tagged dicts ({TAG: "Completion", "fields": {...}}) and are rebuilt from the allow-list
the caller passes (`classes`: the loop's GroupTask, GroupResult and the engine's Completion); nothing else.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch

TAG = "__moerl_type__"
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def _allowed(classes: tuple[type, ...]) -> dict[str, type]:
    bad = [getattr(c, "__name__", repr(c)) for c in classes if not dataclasses.is_dataclass(c)]
    if bad:
        raise TypeError(f"controller state classes must be dataclasses: {bad}")
    return {c.__name__: c for c in classes}


def _encode(obj: Any, classes: dict[str, type], where: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, _PLAIN):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, classes, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    if isinstance(obj, (set, frozenset)):
        return {TAG: "set", "items": [_encode(v, classes, f"{where}{{}}") for v in sorted(obj, key=repr)]}
    if isinstance(obj, dict):
        if TAG in obj:
            raise ValueError(f"controller state at {where}: a dict may not use the reserved key {TAG!r}")
        bad = [k for k in obj if not isinstance(k, (str, int))]
        if bad:
            raise TypeError(f"controller state at {where}: dict key {bad[0]!r} is not a str or int")
        return {k: _encode(v, classes, f"{where}[{k!r}]") for k, v in obj.items()}
    name = type(obj).__name__
    if dataclasses.is_dataclass(obj) and classes.get(name) is type(obj):
        fields = {f.name: _encode(getattr(obj, f.name), classes, f"{where}.{f.name}")
                  for f in dataclasses.fields(obj) if f.init}
        return {TAG: name, "fields": fields}
    raise TypeError(f"controller state at {where}: {type(obj).__module__}.{name} is not allowed "
                    f"(plain containers, numbers, strings, tensors, and {', '.join(sorted(classes))})")


def _decode(obj: Any, classes: dict[str, type]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, classes) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_decode(v, classes) for v in obj)
    if isinstance(obj, dict):
        tag = obj.get(TAG)
        if tag is None:
            return {k: _decode(v, classes) for k, v in obj.items()}
        if tag == "set":
            return {_decode(v, classes) for v in obj["items"]}
        if tag not in classes:
            raise ValueError(f"controller state names class {tag!r}, which is not in the allow-list {sorted(classes)}")
        return classes[tag](**{k: _decode(v, classes) for k, v in obj["fields"].items()})
    return obj


def encode_controller_state(obj: Any, *, classes: tuple[type, ...]) -> bytes:
    """`obj` as bytes; the only dataclasses it may hold are `classes`."""
    buf = io.BytesIO()
    torch.save(_encode(obj, _allowed(classes), "root"), buf)
    return buf.getvalue()


def decode_controller_state(data: bytes, *, classes: tuple[type, ...]) -> Any:
    """Inverse of encode_controller_state. Raises pickle.UnpicklingError on bytes naming any other class,
    ValueError on a tag outside `classes`."""
    raw = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    return _decode(raw, _allowed(classes))
