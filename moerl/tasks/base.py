"""What a task is: a deterministic prompt stream plus a verifiable reward, loaded by dotted path.

    task = load_task("moerl.tasks.arithmetic:ArithmeticTask", {"max_operand": 50}, seed=0)
    prompt = task.prompt_at(cursor)            # same (seed, cursor) -> same prompt, in any process
    reward, error = safe_reward(task, prompt, completion_token_ids)

A task class declares its options as a dataclass in the class attribute `config_class` and is built
as `cls(config)`. `prompt_at` is a pure function of (task seed, index), so the data cursor saved in a
checkpoint is just the next index. Per-prompt randomness comes from `derive_seed` (SHA-256), never
from Python's `hash()`, which is salted per process and would differ between rollout workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
import numbers
import typing
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable


class TaskError(ValueError):
    """A task that cannot be loaded or fed: bad dotted path, unknown option, unreadable data."""


@runtime_checkable
class Tokenizer(Protocol):
    """The few tokenizer calls the framework needs. `bos_token_id` may be None (e.g. Qwen has none)."""

    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...  # no special tokens added

    def decode(self, ids: list[int]) -> str: ...  # special tokens skipped


@dataclass
class Prompt:
    """One prompt of a task's stream; `index` is the data cursor, `task_id` is unique per index."""

    task_id: str
    index: int
    prompt_token_ids: list[int]
    prompt_text: str
    answer: str


@runtime_checkable
class Task(Protocol):
    """A prompt source and a verifiable reward. Optional: `sft_example(index) -> (prompt_ids, target_ids)`
    with target ids ending in EOS, for a supervised warm start (check with `hasattr`)."""

    tokenizer: Tokenizer

    def prompt_at(self, index: int) -> Prompt: ...

    def reward(self, prompt: Prompt, completion_token_ids: list[int]) -> float: ...


def derive_seed(*parts: object) -> int:
    """A 64-bit seed from `parts` that is the same in every process (unlike `hash()` of a str)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def stop_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end a completion: EOS first, then the tokenizer's `stop_token_ids` where it has them (a chat
    tokenizer's `<|im_end|>`...; optional, so any object with the Tokenizer protocol's fields works)."""
    extra = getattr(tokenizer, "stop_token_ids", None) or ()
    return tuple(dict.fromkeys([int(tokenizer.eos_token_id), *(int(i) for i in extra)]))


def completion_text(tokenizer: Tokenizer, completion_token_ids: list[int]) -> str:
    """Decoded completion up to (not including) the first stop token (`stop_token_ids`); kept whole without one."""
    stops = set(stop_token_ids(tokenizer))
    ids = list(completion_token_ids)
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return tokenizer.decode(ids[:end])


def check_index(index: int) -> None:
    """Reject cursors that are not non-negative ints (a float cursor is a resume bug, not a prompt)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise TaskError(f"prompt index must be a non-negative int, got {index!r}")


# ------------------------------------------------------------------------------------------ loading
def import_dotted(dotted: str, what: str = "task") -> Any:
    """The object at `package.module:attr` or `package.module.attr` (`attr` may itself be dotted, e.g. a
    class's method: without a colon the longest importable module prefix is the module); `TaskError`
    naming `what` and the path when it cannot be imported."""
    if ":" in dotted:
        module_name, _, attr = dotted.partition(":")
        splits = [(module_name, attr)] if module_name and attr else []
    else:
        parts = dotted.split(".")
        splits = [(".".join(parts[:k]), ".".join(parts[k:])) for k in range(len(parts) - 1, 0, -1) if all(parts)]
    if not splits:
        raise TaskError(f"cannot load {what} {dotted!r}: expected 'package.module:name' or 'package.module.name'")
    for i, (module_name, attr) in enumerate(splits):
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing_is_prefix = exc.name is not None and (module_name + ".").startswith(exc.name + ".")
            if missing_is_prefix and i + 1 < len(splits):
                continue  # `module_name` is no module: a shorter prefix may be
            raise TaskError(f"cannot load {what} {dotted!r}: {exc}") from exc
        except ImportError as exc:
            raise TaskError(f"cannot load {what} {dotted!r}: {exc}") from exc
        except Exception as exc:  # the module itself raised while importing (a bug or missing data in user code)
            raise TaskError(f"cannot load {what} {dotted!r}: importing {module_name!r} raised "
                            f"{type(exc).__name__}: {exc}") from exc
        try:
            for part in attr.split("."):
                obj = getattr(obj, part)
        except AttributeError as exc:
            raise TaskError(f"cannot load {what} {dotted!r}: {exc}") from exc
        return obj
    raise AssertionError("unreachable")


def _import(dotted: str) -> type:
    obj = import_dotted(dotted, "task")
    if not isinstance(obj, type):
        raise TaskError(f"cannot load task {dotted!r}: {obj!r} is not a class")
    return obj


def _check_type(dotted: str, name: str, value: Any, hint: Any) -> Any:
    """Light type check of one option (options come untyped from TOML/CLI); ints widen to float."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        ok = value in typing.get_args(hint)
        expected = " | ".join(repr(a) for a in typing.get_args(hint))
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value, expected = (float(value) if ok else value), "float"
    elif hint in (int, str, bool):
        ok = isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
        expected = hint.__name__
    else:
        return value  # complex hints are left to the config's own checks
    if not ok:
        raise TaskError(f"task {dotted!r}: option {name!r} must be {expected}, got {value!r}")
    return value


def build_config(dotted: str, config_class: type, options: dict[str, Any], seed: int) -> Any:
    """`config_class(**options)` with unknown / mistyped / missing options reported as `TaskError`."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise TaskError(f"task {dotted!r}: unknown option {unknown[0]!r}; valid options: {', '.join(fields)}")
    hints = typing.get_type_hints(config_class)
    kwargs = {k: _check_type(dotted, k, v, hints.get(k)) for k, v in options.items()}
    if "seed" in fields and "seed" not in kwargs:
        kwargs["seed"] = seed  # the run seed, unless the task's options pin their own
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise TaskError(f"task {dotted!r}: missing required option {missing[0]!r}")
    try:
        return config_class(**kwargs)
    except (TypeError, ValueError) as exc:  # the config's own checks (TaskError is a ValueError)
        raise TaskError(f"task {dotted!r}: {exc}") from exc


def task_config(dotted: str, options: dict[str, Any] | None = None, *, seed: int) -> tuple[type, Any]:
    """The task class and its options built into its `config_class` (names, types and the class's own checks),
    without building the task: no data or tokenizer is read. `moerl config` checks a config's task with it."""
    cls = _import(dotted)
    config_class: Any = getattr(cls, "config_class", None)
    if config_class is None or not dataclasses.is_dataclass(config_class):
        raise TaskError(f"cannot load task {dotted!r}: class has no dataclass `config_class` attribute")
    return cls, build_config(dotted, config_class, dict(options or {}), seed)


def load_task(dotted: str, options: dict[str, Any] | None = None, *, seed: int) -> Task:
    """Import `module:Class` (or `module.Class`), build its `config_class` from `options`, instantiate.

    `seed` (the run seed) fills the config's `seed` field unless `options` sets it explicitly.
    """
    cls, config = task_config(dotted, options, seed=seed)
    task = cls(config)
    missing = [m for m in ("tokenizer", "prompt_at", "reward") if not hasattr(task, m)]
    if missing:
        raise TaskError(f"cannot load task {dotted!r}: not a Task, missing {', '.join(missing)}")
    return task


# ------------------------------------------------------------------------------------------ scoring
_NOT_REAL, _NOT_FINITE = "TypeError: reward returned", "ValueError: reward is not finite"
REWARD_TIMEOUT = "TimeoutError: reward overran"  # how moerl.tasks.scoring reports a reward past its deadline


def safe_reward(task: Task, prompt: Prompt, completion_ids: list[int]) -> tuple[float | None, str | None]:
    """(reward, None), or (None, "ExcType: message") when the reward raised or is not a finite number.

    A failed reward must mark the sample failed, never score it 0: a zero would be a real (wrong)
    learning signal, while a failed sample is dropped from the batch. BaseException too: a reward that calls
    sys.exit (or raises KeyboardInterrupt) fails its sample; it used to take its rollout worker down with it.
    """
    try:
        value = task.reward(prompt, completion_ids)
    except BaseException as exc:  # noqa: BLE001 - any user reward bug becomes a per-sample error
        return None, f"{type(exc).__name__}: {exc}"
    if not isinstance(value, numbers.Real):
        return None, f"{_NOT_REAL} {type(value).__name__} {value!r:.200}, expected a real number"
    value = float(value)
    if not math.isfinite(value):
        return None, f"{_NOT_FINITE}: {value}"
    return value, None


def reward_error_kind(error: str) -> str:
    """What a `safe_reward` (or moerl.tasks.scoring) error says of the reward, as in "their reward <kind>"."""
    if error.startswith((_NOT_REAL, _NOT_FINITE)):
        return "was not a finite real number"
    if error.startswith(REWARD_TIMEOUT):
        return "overran task.reward_timeout_s"
    return "raised"


__all__ = [
    "Prompt", "Task", "TaskError", "Tokenizer", "build_config", "check_index",
    "completion_text", "derive_seed", "import_dotted", "load_task", "reward_error_kind", "safe_reward",
    "stop_token_ids", "task_config",
]
