"""Verifiable rewards on decoded text, and the weighted list of them a task scores with.

Built in, by name (each `fn(completion_text, answer) -> float`):
    math         1.0 when the completion's final answer equals the reference mathematically, by math-verify
                 (`\\boxed{x^2+1}` = `1+x^2`, `\\sqrt{2}/2` = `\\frac{\\sqrt{2}}{2}`, `50\\%` = `50`, `1,000` = `1000`;
                 the final answer is the \\boxed{} one, else the last expression), bounded in time on any thread
                 (math_grader.py); an answer that is no math (a name, a letter) matches as normalised text
    exact_match  1.0 when the texts are equal after stripping surrounding whitespace
    boxed        1.0 when the completion gives a final answer in a closed \\boxed{...} (a format reward)

A task's `reward` option is one name or dotted path (`pkg.module:function` or `pkg.module.function`, any
callable of (completion_text, answer)), or a list of them with weights, summed:

    reward = "math"
    reward = [{ name = "math", weight = 1.0 }, { name = "boxed", weight = 0.1 }, "my_pkg.rewards:length_penalty"]

Reward functions are trusted code (like the task); completions and answers are untrusted data.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moerl.tasks.base import TaskError, import_dotted
from moerl.tasks.math_grader import math_equal

RewardFn = Callable[[str, str], float]


def exact_match(completion_text: str, answer: str) -> float:
    """1.0 when the texts are equal after stripping surrounding whitespace."""
    return 1.0 if completion_text.strip() == answer.strip() else 0.0


def last_boxed(text: str) -> str | None:
    """Content of the last closed `\\boxed{...}`, nested braces included; None if there is none."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth = 0
        for i in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len("\\boxed{"): i]
        start = text.rfind("\\boxed{", 0, start)  # unclosed (cut off): try an earlier one
    return None


def _normalise(text: str) -> str:
    """Form-only differences removed: case, spaces, surrounding `$`, a trailing period."""
    return text.strip().strip("$").lower().replace(" ", "").removesuffix(".").strip("$")


def math_answer(completion_text: str, answer: str, timeout_s: int = 5) -> float:
    """1.0 when the completion's final answer equals `answer` by math-verify (each parse and comparison bounded
    by `timeout_s`), or, for answers that are no math, when its last \\boxed{} (else the whole text) equals
    `answer` as normalised text (case, spaces, `$`, a trailing period ignored)."""
    if math_equal(completion_text, answer, timeout_s):
        return 1.0
    boxed = last_boxed(completion_text)
    target = _normalise(answer)
    return 1.0 if target and _normalise(completion_text if boxed is None else boxed) == target else 0.0


def boxed(completion_text: str, answer: str) -> float:
    """Format reward: 1.0 when the completion holds a closed \\boxed{...}, whatever is in it."""
    return 0.0 if last_boxed(completion_text) is None else 1.0


BUILTIN = {"math": math_answer, "exact_match": exact_match, "boxed": boxed}


# ------------------------------------------------------------------------------------------ weighted list
@dataclass(frozen=True)
class RewardTerm:
    name: str  # a built-in name or a dotted path, as configured
    weight: float
    fn: RewardFn


def load_reward(name: str, math_timeout_s: int = 5) -> RewardFn:
    """A built-in by name, else the callable at a dotted path (imported now, so a typo fails at load)."""
    if name == "math":
        return functools.partial(math_answer, timeout_s=math_timeout_s)
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name and "." not in name:
        raise TaskError(f"unknown reward {name!r}: one of {', '.join(BUILTIN)} or a dotted path "
                        "'package.module:function'")
    fn = import_dotted(name, "reward")
    if not callable(fn):
        raise TaskError(f"reward {name!r} is not callable: {fn!r}")
    return fn


def reward_terms(spec: Any, math_timeout_s: int = 5) -> list[RewardTerm]:
    """The weighted terms of a `reward` option: a name, or a list of names and {name, weight} tables."""
    items = spec if isinstance(spec, list) else [spec]
    terms = []
    for item in items:
        if isinstance(item, str):
            name, weight = item, 1.0
        elif isinstance(item, dict) and isinstance(item.get("name"), str) and set(item) <= {"name", "weight"}:
            name, weight = item["name"], item.get("weight", 1.0)
            if not isinstance(weight, numbers.Real) or isinstance(weight, bool):
                raise TaskError(f"reward {name!r}: weight must be a number, got {weight!r}")
        else:
            raise TaskError(f"option 'reward': expected a name, a dotted path or a list of them and "
                            f"{{name = ..., weight = ...}} tables, got {item!r}")
        terms.append(RewardTerm(name, float(weight), load_reward(name, math_timeout_s)))
    if not terms:
        raise TaskError("option 'reward' is an empty list")
    return terms


def score(terms: list[RewardTerm], completion_text: str, answer: str) -> float:
    """Σ weight · term(completion, answer). A term that raises or returns no number fails the sample
    (safe_reward), rather than scoring it."""
    total = 0.0
    for term in terms:
        value = term.fn(completion_text, answer)
        if not isinstance(value, numbers.Real):
            raise TypeError(f"reward {term.name!r} returned {type(value).__name__} {value!r}, expected a number")
        total += term.weight * float(value)
    return total
