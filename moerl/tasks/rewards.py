"""Verifiable rewards on decoded text: exact match, and math final-answer equivalence.

`math_answer` is lenient about form and strict about value: "1,000", "1000.0", "\\boxed{1000}"
all score against "1000", while a wrong value never does. The final answer is the last
`\\boxed{...}`; without one, the last number in the text when the reference is numeric (a model's
working usually precedes its answer), else the whole text.
"""

from __future__ import annotations

import re
from fractions import Fraction

_REL_TOL = Fraction(1, 10**6)
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")
_EXPONENT = re.compile(r"e([-+]?\d+)$")


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


def parse_number(text: str) -> Fraction | None:
    """Exact value of "3", "-3.0", "1,000", "1/2", "0.5", "$5$", "\\frac{1}{2}"; None if not a number.

    Fractions rather than floats: huge integers cannot overflow and "1/3" is exact. Exponents are
    bounded so a sampled "1e999999999" cannot stall a reward worker.
    """
    s = _normalise(text)
    if m := _FRAC.match(s):
        s = f"{m[1]}{m[2]}/{m[3]}"
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if (e := _EXPONENT.search(s)) and abs(int(e[1])) > 1000:
        return None
    try:
        num, _, den = s.partition("/")
        return Fraction(num) / Fraction(den or 1)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(completion_text: str, numeric: bool) -> str:
    """The completion's final answer: last \\boxed{}, else (numeric) the last number, else all of it."""
    boxed = last_boxed(completion_text)
    if boxed is not None:
        return boxed
    if numeric:
        numbers = _NUMBER.findall(completion_text)
        return numbers[-1] if numbers else ""
    return completion_text


def math_answer(completion_text: str, answer: str) -> float:
    """1.0 when the completion's final answer equals `answer`: numerically (1e-6 relative) when both
    are numbers, else as normalised strings (case, spaces, `$`, trailing period ignored)."""
    reference = parse_number(answer)
    predicted = extract_answer(completion_text, numeric=reference is not None)
    value = parse_number(predicted)
    if reference is not None and value is not None:
        return 1.0 if abs(value - reference) <= _REL_TOL * max(abs(value), abs(reference)) else 0.0
    target = _normalise(answer)
    return 1.0 if target and _normalise(predicted) == target else 0.0
