"""The generic loader behind `moerl.config`: any nested dataclass schema from TOML files and dotted overrides.

Precedence: field defaults < TOML file < overrides. Unknown keys, wrong types and failed `validate()` checks raise
`ConfigError` naming the dotted key. On the command line an override value is parsed as a TOML literal (`20`, `3.5`,
`true`, `[1, 2]`, `"x"`), else taken as a plain string; `none`/`null` sets an Optional field to None (TOML has no
null: `dump_toml` omits None). `moved` maps keys that have moved (old dotted key -> new) to a ConfigError naming the
new one. The schema and its defaults live in moerl/config.py, which calls these with `MoerlConfig`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar, Union, get_args, get_origin

from moerl.checks import CheckFailed, ConfigError
from moerl.redact import MASK, redact, redact_config, secret_key

T = TypeVar("T")
COMMAND_LINE = "the command line"


def load_config(path: str | Path | None, overrides: Sequence[str], cls: type[T],
                moved: Mapping[str, str] | None = None) -> T:
    """Defaults, then the TOML file at `path` (None: defaults only), then `--dotted.key=value` overrides."""
    source = "defaults" if path is None else str(path)
    data = {} if path is None else _read_toml(Path(path))
    merged = config_to_dict(config_from_dict(data, cls, source=source, validate=False, moved=moved))
    for item in [overrides] if isinstance(overrides, str) else overrides:
        _apply_override(merged, cls, item, moved or {})
    return config_from_dict(merged, cls, source=source, moved=moved)


def config_from_dict(data: Mapping[str, Any], cls: type[T], *, source: str = "<dict>",
                     validate: bool = True, moved: Mapping[str, str] | None = None) -> T:
    """Build and type-check `cls` from nested mappings; missing keys keep their defaults."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config from {source} must be a table, got {type(data).__name__}")
    cfg = _build(cls, data, "", _Context(source, cls, moved or {}))
    if validate:
        _validate(cfg, "")
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dicts/lists/scalars (tuples become lists; None is kept)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"config_to_dict expects a dataclass instance, got {type(cfg).__name__}")
    return _to_plain(cfg)


def dump_toml(cfg: Any) -> str:
    """TOML text that `load_config` reads back to an equal config (None values are omitted)."""
    lines: list[str] = []
    _write_table(config_to_dict(cfg), [], lines)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ machinery
class _Context(NamedTuple):
    source: str
    """file path, COMMAND_LINE or "<dict>", for error messages"""
    root: type
    """the top-level schema, for "did you mean" suggestions"""
    moved: Mapping[str, str]
    """keys that have moved: old dotted key -> new"""


def _read_toml(path: Path) -> dict[str, Any]:
    try:  # a UTF-8 byte-order mark (Windows editors write one) is no TOML statement: read past it
        return tomllib.loads(path.read_bytes().removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"invalid TOML in config file {path}: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None


def _field_types(cls: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _strip_optional(tp: Any) -> Any:
    """X for `X | None`, else `tp` itself."""
    options = [a for a in get_args(tp) if a is not type(None)] if _is_union(tp) else []
    return options[0] if len(options) == 1 else tp


def _all_keys(cls: Any, prefix: str = "") -> Iterator[str]:
    for name, tp in _field_types(cls).items():
        yield prefix + name
        if dataclasses.is_dataclass(inner := _strip_optional(tp)):
            yield from _all_keys(inner, f"{prefix}{name}.")


def _where(ctx: _Context) -> str:
    return f"on {ctx.source}" if ctx.source == COMMAND_LINE else f"in {ctx.source}"


def _moved(key: str, ctx: _Context) -> ConfigError | None:
    """The error for a key listed in MOVED_KEYS, naming its new place; None for any other key."""
    if key not in ctx.moved:
        return None
    return ConfigError(f"config key {key!r} has moved to {ctx.moved[key]!r} ({_where(ctx)})")


def _unknown(key: str, siblings: Iterable[str], prefix: str, ctx: _Context, section: bool) -> ConfigError:
    """The error for an unknown key, with the closest valid key: same name elsewhere, sibling, any."""
    everywhere, here = list(_all_keys(ctx.root)), [prefix + name for name in siblings]
    same_name = [k for k in everywhere if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    close = difflib.get_close_matches
    match = same_name or close(key, here, n=1) or close(key, everywhere, n=1)
    hint = f"did you mean {match[0]!r}?" if match else f"valid keys here: {', '.join(here) or 'none'}"
    return ConfigError(f"unknown config {'section' if section else 'key'} {key!r} ({_where(ctx)}); {hint}")


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if _is_union(tp):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if dataclasses.is_dataclass(tp):
        return f"a table ({tp.__name__})"
    if origin is not None:
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return getattr(tp, "__name__", repr(tp))


def _wrong_type(key: str, tp: Any, value: Any, ctx: _Context) -> ConfigError:
    shown = MASK if secret_key(key) else f"{repr(value)[:80]} ({type(value).__name__})"  # never echo a credential
    return ConfigError(f"config key {key!r} expects {_type_name(tp)}, got {shown} from {ctx.source}")


def _build(cls: type[T], data: Mapping[str, Any], prefix: str, ctx: _Context) -> T:
    types_by_name = _field_types(cls)
    for name, value in data.items():
        if name not in types_by_name:
            raise _moved(prefix + str(name), ctx) or _unknown(
                prefix + str(name), types_by_name, prefix, ctx, isinstance(value, Mapping))
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.init and f.name not in data and f.default is f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"config key {prefix + f.name!r} is required but missing from {ctx.source}")
    return cls(**{name: _convert(v, types_by_name[name], prefix + name, ctx) for name, v in data.items()})


def _convert(value: Any, tp: Any, key: str, ctx: _Context) -> Any:
    """`value` checked against type `tp` and converted to it (int->float, list->tuple, table->dataclass)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if _is_union(tp):
        if value is None and type(None) in args:
            return None
        if (inner := _strip_optional(tp)) is tp:
            raise TypeError(f"config key {key!r}: only `X | None` unions are supported, not {tp!r}")
        return _convert(value, inner, key, ctx)
    elif origin is Literal:
        if any(type(value) is type(choice) and value == choice for choice in args):
            return value
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, Mapping):
            return _build(tp, value, key + ".", ctx)  # type: ignore[arg-type]
    elif tp in (bool, str):
        if isinstance(value, tp):
            return value
    elif tp in (int, float):  # bool is an int subclass, but never a number here
        if isinstance(value, (int, float) if tp is float else int) and not isinstance(value, bool):
            return tp(value)
    elif origin in (list, tuple) and (origin is list or args[1:] == (Ellipsis,)):
        if isinstance(value, (list, tuple)):
            items = [_convert(v, args[0] if args else Any, f"{key}[{i}]", ctx) for i, v in enumerate(value)]
            return items if origin is list else tuple(items)
    elif origin is tuple:  # fixed length: tuple[float, float]
        if isinstance(value, (list, tuple)):
            if len(value) != len(args):
                raise ConfigError(f"config key {key!r} expects exactly {len(args)} items ({_type_name(tp)}), "
                                  f"got {len(value)} from {ctx.source}")
            return tuple(_convert(v, a, f"{key}[{i}]", ctx) for i, (v, a) in enumerate(zip(value, args)))
    elif origin is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return {k: _convert(v, args[1] if args else Any, f"{key}.{k}", ctx) for k, v in value.items()}
    else:
        raise TypeError(f"config key {key!r} has a type the config loader does not support: {tp!r}")
    raise _wrong_type(key, tp, value, ctx)


def _validate(obj: Any, prefix: str) -> None:
    """Call each dataclass's optional `validate()`, innermost sections first."""
    for f in dataclasses.fields(obj):
        if dataclasses.is_dataclass(value := getattr(obj, f.name)):
            _validate(value, f"{prefix}{f.name}.")
    if not callable(check := getattr(obj, "validate", None)):
        return
    try:
        check()
    except CheckFailed as err:
        try:
            value = functools.reduce(getattr, err.key.split('.'), obj)
            got = f", got {redact(repr(redact_config(value)))}"  # a refused launch.env holds the credential itself
        except AttributeError:
            got = ""
        raise ConfigError(f"config key {prefix + err.key!r} {err.message}{got}") from None
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(f"config section {prefix.rstrip('.') or '<root>'!r} is invalid: {err}") from err


def _convert_cli(raw: str | None, tp: Any, key: str, ctx: _Context) -> Any:
    """An override value: a TOML literal (`20`, `true`, `[1, 2]`, `"x"`) if it is one, else the string."""
    if raw is None:  # a bare flag
        if _strip_optional(tp) is bool or (get_origin(tp) is Literal and any(a is True for a in get_args(tp))):
            return True
        raise ConfigError(f"config key {key!r} needs a value on {ctx.source}: --{key}=VALUE")
    if _is_union(tp) and type(None) in get_args(tp) and raw.strip().lower() in ("none", "null"):
        return None
    try:
        doc = tomllib.loads(f"value = {raw}")
        parsed = doc["value"] if len(doc) == 1 else raw
    except tomllib.TOMLDecodeError:
        parsed = raw
    try:
        return _convert(parsed, tp, key, ctx)
    except ConfigError:
        if isinstance(parsed, str):
            raise
        try:  # e.g. `--run.name=2024` is the string "2024" for a str field
            return _convert(raw, tp, key, ctx)
        except ConfigError:
            pass
        raise


def _apply_override(data: dict[str, Any], cls: type, item: str, moved: Mapping[str, str]) -> None:
    """Set one `--a.b.c=value` override into `data`, the plain-dict form of a `cls` config."""
    key, has_value, raw = (item[2:] if item.startswith("--") else item).partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"malformed override {item!r} on {COMMAND_LINE}; expected --section.key=value")
    ctx, tp, node, i = _Context(COMMAND_LINE, cls, moved), cls, data, 0
    while True:
        target, prefix = _strip_optional(tp), "".join(p + "." for p in parts[:i])
        if dataclasses.is_dataclass(target):
            types_by_name = _field_types(target)
            name = parts[i] if parts[i] in types_by_name else parts[i].replace("-", "_")
            if name not in types_by_name:
                raise _moved(prefix + ".".join([name, *parts[i + 1:]]), ctx) or _unknown(
                    prefix + ".".join(parts[i:]), types_by_name, prefix, ctx, section=False)
            parts[i], tp, i = name, types_by_name[name], i + 1
        elif get_origin(target) is dict:  # the rest of the dotted key is one dict key
            name, tp, i = ".".join(parts[i:]), (get_args(target) or (str, Any))[1], len(parts)
        else:
            raise _unknown(".".join(parts), (), "", ctx, section=False)
        if i == len(parts):
            node[name] = _to_plain(_convert_cli(raw if has_value else None, tp, ".".join(parts), ctx))
            return
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _to_plain(v) for k, v in value.items()}
    return value


_TOML_ESCAPES = {i: f"\\u{i:04x}" for i in [*range(0x20), 0x7F]} | {
    ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\t"): "\\t", ord("\r"): "\\r"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # float repr is exact and valid TOML, inf and nan included
    if isinstance(value, str):
        return f'"{value.translate(_TOML_ESCAPES)}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):  # an inline table, e.g. in a list: task.options.reward = [{ name = "math" }]
        items = [f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items() if v is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise TypeError(f"dump_toml cannot write {type(value).__name__} values: {value!r}")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)


def _write_table(table: Mapping[str, Any], path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if v is not None and not isinstance(v, Mapping)}
    tables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    if path and (scalars or not tables):  # an empty table still gets its header
        lines.extend(([""] if lines else []) + ["[" + ".".join(map(_toml_key, path)) + "]"])
    lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items())
    for k, v in tables.items():
        _write_table(v, path + [k], lines)


def field_type_name(cls: type, name: str) -> str:
    """How a field's type reads in errors and the reference: `int`, `one of 'async', 'sync'`, `list[str]`."""
    return _type_name(_field_types(cls)[name])


def toml_value(value: Any) -> str:
    """A value as TOML writes it (`dump_toml`'s form)."""
    return _toml_value(_to_plain(value))
