"""Math answer equivalence by `math-verify`, bounded in time on any thread.

math-verify parses LaTeX and plain expressions into sympy and compares them (`x^2+1` = `1+x^2`,
`\\frac{\\sqrt{2}}{2}` = `\\sqrt{2}/2`, `50\\%` = `50`). Sympy can take unbounded time on a hostile answer
(`9^{9^{9^{9}}}`), so math-verify bounds each parse and comparison with `signal.alarm`, which only works on a
process's main thread: elsewhere it refuses and scores everything as unequal. Rewards run on the rollout
worker's threads (a threaded Ray actor), so:

    main thread   in process, math-verify's own alarm bounds each step (`timeout_s` each)
    other thread  in a child process (one per process, started on first use, one request at a time) whose
                  main thread runs the same code with the alarm; a child that does not answer within
                  3 * timeout_s + 10 s is killed, that answer counts as unequal and the next call starts a new one

An answer that cannot be verified within the bound is unequal (scores 0), as math-verify itself decides.
The child is `python -m moerl.tasks.math_grader` speaking one JSON object per line on stdin/stdout.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


def _gold_text(answer: str) -> str:
    """The reference as math-verify's LaTeX extraction expects it: boxed, unless it holds a box already."""
    answer = answer.strip()
    if "\\boxed" in answer:
        return answer
    if len(answer) >= 2 and answer[0] == answer[-1] == "$":
        answer = answer.strip("$")
    return f"\\boxed{{{answer}}}"


def equal_here(predicted: str, answer: str, timeout_s: int) -> bool:
    """math-verify on this thread: the main thread (for its alarm), or any thread when timeout_s is 0 (no bound)."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError("the math reward needs math-verify: pip install 'math-verify'") from None
    gold = parse(_gold_text(answer), extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout_s)
    if not gold:
        return False
    pred = parse(predicted, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()],
                 parsing_timeout=timeout_s)
    return bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout_s))


class _Child:
    """One grading child process, started lazily, restarted after a crash or a kill."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the same packages as here
        proc = subprocess.Popen([sys.executable, "-m", "moerl.tasks.math_grader"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env)
        self._buffer = b""
        return proc

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _readline(self, deadline: float) -> bytes | None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the child died
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def equal(self, predicted: str, answer: str, timeout_s: int) -> bool:
        request = json.dumps({"predicted": predicted, "answer": answer, "timeout_s": timeout_s}).encode() + b"\n"
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.write(request)
                self._proc.stdin.flush()
            except BrokenPipeError:
                line = None
            else:
                line = self._readline(time.monotonic() + 3 * timeout_s + 10)
            if line is None:
                log.warning("math grader gave no answer within %d s (or died): scored 0, restarting it",
                            3 * timeout_s + 10)
                self.stop()
                return False
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"math grader: {reply['error']}")
        return bool(reply["equal"])


_CHILD = _Child()
atexit.register(_CHILD.stop)


def math_equal(predicted: str, answer: str, timeout_s: int = 5) -> bool:
    """Whether the completion's final answer equals `answer` mathematically, within the time bound."""
    if threading.current_thread() is threading.main_thread():
        return equal_here(predicted, answer, timeout_s)
    return _CHILD.equal(predicted, answer, timeout_s)


def _serve() -> None:
    """The child: one request per line in, one reply per line out, until stdin closes."""
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # timeouts count as unequal, as in the parent
    out = os.fdopen(os.dup(1), "wb")  # replies only: whatever a library prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin.buffer:
        try:
            req = json.loads(line)
            reply: dict[str, Any] = {"equal": equal_here(req["predicted"], req["answer"], int(req["timeout_s"]))}
        except Exception as exc:  # noqa: BLE001 - reported to the caller, which fails that sample
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve()
