"""The math reward: math-verify's equivalences, the same answers off the main thread (rollout workers score on
threads, where math-verify's alarm cannot run), and a bound in time on both."""

from __future__ import annotations

import threading
import time

import pytest

from moerl.tasks import math_grader
from moerl.tasks.rewards import math_answer

CASES = [
    ("\\boxed{x^2+1}", "1+x^2", 1.0),
    ("so $1+x^2$", "x^2+1", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{50}", "50\\%", 1.0),
    ("\\boxed{51}", "50\\%", 0.0),
    ("\\boxed{x^2-1}", "1+x^2", 0.0),
    ("\\boxed{B}", "B", 1.0),
    ("\\boxed{ Paris. }", "paris", 1.0),
]
HOSTILE = "\\boxed{9^{9^{9^{9}}}}"  # sympy would evaluate this for ever


def on_thread(fn, *args):
    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn(*args)))
    worker.start()
    worker.join(60)
    return out[0]


def test_math_verify_equivalences_on_the_main_thread_and_off_it():
    assert [math_answer(c, a) for c, a, _ in CASES] == [e for _, _, e in CASES]
    assert on_thread(lambda: [math_answer(c, a) for c, a, _ in CASES]) == [e for _, _, e in CASES]


def test_a_hostile_answer_is_bounded_in_time_on_any_thread():
    t0 = time.monotonic()
    assert math_answer(HOSTILE, "1", timeout_s=1) == 0.0  # math-verify's alarm, here on the main thread
    assert time.monotonic() - t0 < 8
    t0 = time.monotonic()
    assert on_thread(math_answer, HOSTILE, "1", 1) == 0.0  # the child's alarm
    assert time.monotonic() - t0 < 8
    assert on_thread(math_answer, "\\boxed{5}", "5") == 1.0  # and the child still serves


def test_a_child_that_dies_or_hangs_is_replaced(monkeypatch):
    child = math_grader._CHILD
    assert on_thread(math_grader.math_equal, "\\boxed{2}", "2") is True
    pid = child._proc.pid
    child._proc.kill()
    child._proc.wait()
    assert on_thread(math_grader.math_equal, "\\boxed{2}", "2") is True  # a dead child is replaced
    assert child._proc.pid != pid
    monkeypatch.setattr(child, "_readline", lambda deadline: None)  # a child that never answers in time
    assert on_thread(math_grader.math_equal, "\\boxed{2}", "2") is False
    assert child._proc is None  # killed; the next call starts a fresh one


@pytest.mark.parametrize("answer", ["$\\frac{1}{2}$", "The answer is \\boxed{0.5}"])
def test_references_in_latex_or_with_a_box(answer):
    assert math_answer("\\boxed{1/2}", answer) == 1.0
