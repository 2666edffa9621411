"""What `moerl train` prints while it runs: stage lines during start-up, the warm start's progress, the live
progress line of the RL steps, and events as lines of their own:

    [0:00:00] starting Ray (local, 2 CPUs)
    [0:00:04] Ray up; starting 1 trainer rank
    warm start 40/40 | loss/sft 0.412 | 0:00:21
    [0:00:22] rollout worker rollout-0 up (1/2)
    step 12/50 | reward 0.41 | 38.2 samples/s | entropy 0.62 | ess 0.97 | clip 0.03 | staleness 0.8 | queue 5 | ...
    [0:01:20] checkpoint step 20 saved to runs/demo/checkpoints/step-20

On a terminal the live line is rewritten in place (`\\r`) and stage and event lines are printed above it. Elsewhere
(CI, a log file) a full line is printed at most every `log_interval_s` seconds (and at most once per step),
plus the first and the last step, so logs stay readable; stage and event lines always. Fields whose metric is
missing are left out. The ETA is the remaining steps at the rate of the last `eta_window` steps.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import threading
import time
from typing import Any, Callable, Literal, Mapping, TextIO

from moerl.runlog.run_log import STEP_PHASES

REWARD_KEY = "reward/mean"
SAMPLES_PER_S_KEY = "throughput/samples_per_s"
STALENESS_KEY = "staleness/mean"
# training health (moerl/runlog/health.py): what falls first when an off-policy run collapses
HEALTH_KEYS = (("policy/entropy", "entropy", ".2g", 6), ("is/ess", "ess", ".2f", 7), ("policy/clip_frac", "clip", ".2f", 8))
QUEUE_KEY = "queue/pending"
WORKERS_ALIVE_KEY = "workers/alive"
WORKERS_TARGET_KEY = "workers/target"
WORKERS_WAITING_KEY = "workers/waiting"  # asked for, not placed: waiting for capacity (moerl/actors/pools.py)


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


def format_line(step: int, total_steps: int, metrics: Mapping[str, Any], elapsed_s: float,
                eta_s: float | None = None, width: int | None = None) -> str:
    """One progress line; fields whose metric is missing are left out, and so is an unknown ETA. With `width`
    (a terminal's columns) the least useful fields are left out until it fits: the step, reward, rate, elapsed
    time and ETA stay (a line cut at the terminal's edge lost the ETA first)."""
    parts: list[tuple[int, str]] = [(0, f"step {step}/{total_steps}")]  # (drop order: highest first, text)
    if REWARD_KEY in metrics:
        parts.append((1, f"reward {_fmt_float(_number(metrics, REWARD_KEY), '.3g')}"))
    if SAMPLES_PER_S_KEY in metrics:
        parts.append((2, f"{_fmt_float(_number(metrics, SAMPLES_PER_S_KEY), '.1f')} samples/s"))
    for key, name, spec, drop in HEALTH_KEYS:
        if key in metrics:
            parts.append((drop, f"{name} {_fmt_float(_number(metrics, key), spec)}"))
    if STALENESS_KEY in metrics:
        parts.append((9, f"staleness {_fmt_float(_number(metrics, STALENESS_KEY), '.1f')}"))
    if QUEUE_KEY in metrics:
        parts.append((10, f"queue {_fmt_int(_number(metrics, QUEUE_KEY))}"))
    if WORKERS_ALIVE_KEY in metrics:
        alive = _fmt_int(_number(metrics, WORKERS_ALIVE_KEY))
        waiting = _number(metrics, WORKERS_WAITING_KEY)
        if WORKERS_TARGET_KEY in metrics and waiting:  # a fleet still growing: say how far
            alive += (f" of {_fmt_int(_number(metrics, WORKERS_TARGET_KEY))} up, {_fmt_int(waiting)} waiting for "
                      "capacity")
        elif WORKERS_TARGET_KEY in metrics:
            alive += f"/{_fmt_int(_number(metrics, WORKERS_TARGET_KEY))}"
        parts.append((5, f"workers {alive}"))
    step_s = _number(metrics, "time/step_s")
    if step_s:  # where the loop's time went this step (moerl/loop/phases.py), largest first
        shares = sorted(((v / step_s, short) for phase, short, _ in STEP_PHASES
                         if (v := _number(metrics, f"time/{phase}_s")) is not None and v / step_s >= 0.05),
                        reverse=True)
        if shares:
            parts.append((11, f"{step_s:.2g}s: " + " ".join(f"{short} {100 * frac:.0f}%" for frac, short in shares)))
    parts.append((4, format_duration(elapsed_s)))
    if eta_s is not None and math.isfinite(eta_s) and step < total_steps:
        parts.append((3, f"eta {format_duration(eta_s)}"))
    line = " | ".join(text for _, text in parts)
    while width and len(line) >= width and len(parts) > 1:  # one column is kept free for the cursor
        parts.remove(max(parts, key=lambda p: p[0]))
        line = " | ".join(text for _, text in parts)
    return line


def format_warm_start(step: int, total_steps: int, metrics: Mapping[str, Any], elapsed_s: float,
                      eta_s: float | None = None) -> str:
    """The warm start's progress line: its step and its losses (`loss/...` or `sft/loss/...` keys)."""
    parts = [f"warm start {step}/{total_steps}"]
    for key in metrics:
        if key.removeprefix("sft/").startswith("loss/"):
            parts.append(f"{key.removeprefix('sft/')} {_fmt_float(_number(metrics, key), '.3g')}")
    parts.append(format_duration(elapsed_s))
    if eta_s is not None and math.isfinite(eta_s) and step < total_steps:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)



def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """Live progress of a run of `total_steps` trainer steps on `stream` (None: silent). Thread-safe.

    `tty` overrides the stream's isatty(); `clock` (monotonic seconds) is for tests.
    """

    def __init__(
        self,
        total_steps: int,
        stream: TextIO | None | Literal["stderr"] = "stderr",
        *,
        log_interval_s: float = 30.0,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        eta_window: int = 20,
    ) -> None:
        self.total_steps = int(total_steps)
        self._stream = stream  # "stderr": the sys.stderr of each write (a default of sys.stderr would bind the one
        # of import time: a test's captured stream, or one a caller has since replaced); None: silent
        self.log_interval_s = float(log_interval_s)
        self.tty = (_is_tty(self.stream) if self.stream is not None else False) if tty is None else tty
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.RLock()
        self._last_print: float | None = None
        self._last_printed: tuple[str, int] | None = None  # (phase, step) of the last line printed (non-TTY)
        self._pending: str | None = None  # the newest line not printed yet (non-TTY)
        self._shown_len = 0  # length of the line now on the terminal (TTY)
        self._closed = False
        self._recent: collections.deque[tuple[str, int, float]] = collections.deque(maxlen=max(2, eta_window + 1))
        self.last_line = ""

    @property
    def stream(self) -> TextIO | None:
        return sys.stderr if self._stream == "stderr" else self._stream

    def elapsed(self) -> float:
        return self._clock() - self._t0

    def eta(self, phase: str, step: int, total: int) -> float | None:
        """Seconds left at the rate of the recent steps of `phase`; None until two steps have been seen."""
        points = [(s, t) for p, s, t in self._recent if p == phase]
        if len(points) < 2 or points[-1][0] <= points[0][0] or points[-1][1] <= points[0][1]:
            return None
        (s0, t0), (s1, t1) = points[0], points[-1]
        return max(0, total - step) * (t1 - t0) / (s1 - s0)

    def update(self, step: int, metrics: Mapping[str, Any]) -> str:
        """Show the state after RL step `step`; returns the line (printed or not)."""
        with self._lock:
            self._recent.append(("rl", step, self._clock()))
            line = format_line(step, self.total_steps, metrics, self.elapsed(),
                               self.eta("rl", step, self.total_steps), self._terminal_width() if self.tty else None)
            self._show("rl", step, step >= self.total_steps, line)
            return line

    def warm_start(self, step: int, total_steps: int, metrics: Mapping[str, Any]) -> str:
        """Show the supervised warm start after its step `step` (1-based) of `total_steps`; the last one stays."""
        with self._lock:
            self._recent.append(("sft", step, self._clock()))
            line = format_warm_start(step, total_steps, metrics, self.elapsed(), self.eta("sft", step, total_steps))
            self._show("sft", step, step >= total_steps, line)
            if step >= total_steps:
                self._end_live_line()
            return line

    def message(self, text: str) -> None:
        """Print a log message without garbling the live line (it is redrawn below the message)."""
        with self._lock:
            if self.stream is None:
                return
            if self.tty and self._shown_len:
                self._write("\r" + " " * self._shown_len + "\r" + text + "\n")
                line, self._shown_len = self.last_line, 0
                if not self._closed and line:
                    self._draw(line)
            else:
                self._write(text + "\n")

    def stage(self, text: str) -> None:
        """A line saying what the run does now (start-up) or what just happened (an event), with the time."""
        self.message(f"[{format_duration(self.elapsed())}] {text}")

    def close(self) -> None:
        """End the live line (TTY) or print the last state not yet printed (non-TTY). Idempotent."""
        with self._lock:
            if self._closed or self.stream is None:
                self._closed = True
                return
            self._closed = True
            if self.tty:
                if self._shown_len:
                    self._write("\n")
                    self._shown_len = 0
            elif self._pending is not None:
                self._write(self._pending + "\n")
                self._pending = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _show(self, phase: str, step: int, final: bool, line: str) -> None:
        self.last_line = line
        if self.stream is None or self._closed:
            return
        if self.tty:
            self._draw(line)
            return
        now = self._clock()
        due = (self._last_print is None or final or now - self._last_print >= self.log_interval_s
               or (self._last_printed is not None and self._last_printed[0] != phase))
        if due and (phase, step) != self._last_printed:
            self._write(line + "\n")
            self._last_print, self._last_printed, self._pending = now, (phase, step), None
        else:
            self._pending = line

    def _end_live_line(self) -> None:
        """Keep the line on the terminal as it is and start the next one below it (the end of a phase)."""
        if self.tty and self._shown_len and self.stream is not None:
            self._write("\n")
        self._shown_len, self._pending, self.last_line = 0, None, ""
        self._last_print = None  # the next phase's first line is printed at once

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
