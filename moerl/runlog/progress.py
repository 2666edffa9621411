"""The live progress line of `moerl train`:

    step 12/50 | reward 0.41 | 38.2 samples/s | staleness 0.8 | queue 5 | workers 2/2 | 0:01:13

On a terminal the line is rewritten in place (`\\r`). Elsewhere (CI, a log file) a full line is printed
at most every `log_interval_s` seconds (and at most once per step), plus the first and the last step, so
logs stay readable. Fields whose metric is missing are left out.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable, Mapping, TextIO

from moerl.runlog.run_log import STEP_PHASES

REWARD_KEY = "reward/mean"
SAMPLES_PER_S_KEY = "throughput/samples_per_s"
STALENESS_KEY = "staleness/mean"
QUEUE_KEY = "queue/pending"
WORKERS_ALIVE_KEY = "workers/alive"
WORKERS_TARGET_KEY = "workers/target"


def _number(metrics: Mapping[str, Any], key: str) -> float | None:
    v = metrics.get(key)
    if v is None or isinstance(v, bool):
        return None
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # a 0-d tensor / numpy scalar
        v = v.item()
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v


def _fmt_float(v: float | None, spec: str) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return format(v, spec)


def _fmt_int(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return str(int(round(v)))


def format_duration(seconds: float) -> str:
    """H:MM:SS (e.g. 0:01:13, 27:03:09)."""
    s = max(0, int(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_line(step: int, total_steps: int, metrics: Mapping[str, Any], elapsed_s: float) -> str:
    """One progress line; fields whose metric is missing are left out."""
    parts = [f"step {step}/{total_steps}"]
    if REWARD_KEY in metrics:
        parts.append(f"reward {_fmt_float(_number(metrics, REWARD_KEY), '.3g')}")
    if SAMPLES_PER_S_KEY in metrics:
        parts.append(f"{_fmt_float(_number(metrics, SAMPLES_PER_S_KEY), '.1f')} samples/s")
    if STALENESS_KEY in metrics:
        parts.append(f"staleness {_fmt_float(_number(metrics, STALENESS_KEY), '.1f')}")
    if QUEUE_KEY in metrics:
        parts.append(f"queue {_fmt_int(_number(metrics, QUEUE_KEY))}")
    if WORKERS_ALIVE_KEY in metrics:
        alive = _fmt_int(_number(metrics, WORKERS_ALIVE_KEY))
        if WORKERS_TARGET_KEY in metrics:
            alive += f"/{_fmt_int(_number(metrics, WORKERS_TARGET_KEY))}"
        parts.append(f"workers {alive}")
    step_s = _number(metrics, "time/step_s")
    if step_s:  # where the loop's time went this step (moerl/loop/phases.py), largest first
        shares = sorted(((v / step_s, short) for phase, short, _ in STEP_PHASES
                         if (v := _number(metrics, f"time/{phase}_s")) is not None and v / step_s >= 0.05),
                        reverse=True)
        if shares:
            parts.append(f"{step_s:.2g}s: " + " ".join(f"{short} {100 * frac:.0f}%" for frac, short in shares))
    parts.append(format_duration(elapsed_s))
    return " | ".join(parts)



def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """Live progress of a run of `total_steps` trainer steps on `stream` (None: silent).

    `tty` overrides the stream's isatty(); `clock` (monotonic seconds) is for tests.
    """

    def __init__(
        self,
        total_steps: int,
        stream: TextIO | None = sys.stderr,
        *,
        log_interval_s: float = 30.0,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_steps = int(total_steps)
        self.stream = stream
        self.log_interval_s = float(log_interval_s)
        self.tty = (_is_tty(stream) if stream is not None else False) if tty is None else tty
        self._clock = clock
        self._t0 = clock()
        self._last_print: float | None = None
        self._last_printed_step: int | None = None
        self._pending: str | None = None  # the newest line not printed yet (non-TTY)
        self._shown_len = 0  # length of the line now on the terminal (TTY)
        self._closed = False
        self.last_line = ""

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def update(self, step: int, metrics: Mapping[str, Any]) -> str:
        """Show the state after `step`; returns the line (printed or not)."""
        line = format_line(step, self.total_steps, metrics, self.elapsed())
        self.last_line = line
        if self.stream is None or self._closed:
            return line
        if self.tty:
            self._draw(line)
            return line
        now = self._clock()
        due = (
            self._last_print is None
            or step >= self.total_steps
            or now - self._last_print >= self.log_interval_s
        )
        if due and step != self._last_printed_step:
            self._write(line + "\n")
            self._last_print, self._last_printed_step, self._pending = now, step, None
        else:
            self._pending = line
        return line

    def message(self, text: str) -> None:
        """Print a log message without garbling the live line (it is redrawn below the message)."""
        if self.stream is None:
            return
        if self.tty and self._shown_len:
            self._write("\r" + " " * self._shown_len + "\r" + text + "\n")
            line, self._shown_len = self.last_line, 0
            if not self._closed and line:
                self._draw(line)
        else:
            self._write(text + "\n")

    def close(self) -> None:
        """End the live line (TTY) or print the last state not yet printed (non-TTY). Idempotent."""
        if self._closed or self.stream is None:
            self._closed = True
            return
        self._closed = True
        if self.tty:
            if self._shown_len:
                self._write("\n")
        elif self._pending is not None:
            self._write(self._pending + "\n")
            self._pending = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _draw(self, line: str) -> None:
        width = self._terminal_width()
        if width and len(line) >= width:
            line = line[: width - 1]
        pad = max(0, self._shown_len - len(line))
        self._write("\r" + line + " " * pad)
        self._shown_len = len(line)

    def _terminal_width(self) -> int | None:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
            return None

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)  # type: ignore[union-attr]
            self.stream.flush()  # type: ignore[union-attr]
        except (OSError, ValueError):  # a closed or broken stream must not fail the run
            pass

