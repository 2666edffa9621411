"""Everything the user sees of a run, behind the few calls `moerl train` makes (moerl/run.py):

    report = RunReporter(run_dir, total_steps, resume=False, wandb={"project": ..., "name": ..., "mode": ...})
    report.stage("starting Ray")                    # a line while the run starts (with the time since start)
    report.warm_start(i, total, metrics)            # each step of the supervised warm start
    report.begin_rl()                               # the RL steps start: the throughput clock starts
    report.step(step, metrics, rows)                # each RL step (rows with their text: SampleBuilder.add_text)
    report.log_metrics(step, eval_metrics)          # a row of its own (an eval's results)
    report.event("checkpoint", "checkpoint step 100 saved to ...")   # the hook the Ray parts are given
    report.finish()                                 # files closed, the final plots start in the background
    report.close()                                  # waits for the plots; prints how long closing took

Per RL step it adds the windowed throughput to the metrics, writes metrics.jsonl, TensorBoard and
trajectories.jsonl (moerl/runlog/run_log.py), every `samples_every_s` a few sample completions as text to
TensorBoard (and W&B), and updates the progress line (moerl/runlog/progress.py). Plots are written in the
background during the run (moerl/runlog/plots.py `PlotWriter`). An eval's results are a row of their own
(`log_metrics`) and an event line. Nothing here feeds back into training, and no logging error stops the run.
"""

from __future__ import annotations

import collections
import math
import time
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence, TextIO

from moerl.redact import redact
from moerl.runlog.disk import DiskWriteError
from moerl.runlog.plots import PlotWriter
from moerl.runlog.progress import Progress, format_duration
from moerl.runlog.run_log import RunLog

SAMPLES_PER_S_KEY = "throughput/samples_per_s"
TOKENS_PER_S_KEY = "throughput/tokens_per_s"
SAMPLES_PER_S_AVG_KEY = "throughput/samples_per_s_avg"
_TEXT_LIMIT = 2000  # characters of a prompt or completion shown in TensorBoard


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric entries of `metrics` as floats (bools, lists and strings left out)."""
    return {prefix + k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def pick_samples(rows: Sequence[Mapping[str, Any]], k: int) -> list[Mapping[str, Any]]:
    """Up to `k` rows spread over the batch's rewards, lowest to highest (ties keep the batch order)."""
    if k <= 0 or not rows:
        return []
    ranked = sorted(rows, key=lambda r: r.get("reward") if isinstance(r.get("reward"), (int, float)) else -math.inf)
    if len(ranked) <= k:
        return list(ranked)
    if k == 1:
        return [ranked[-1]]
    return [ranked[round(i * (len(ranked) - 1) / (k - 1))] for i in range(k)]


def _clip(text: Any) -> str:
    text = "" if text is None else str(text)
    return text if len(text) <= _TEXT_LIMIT else text[:_TEXT_LIMIT] + f"... ({len(text)} characters)"


def _block(label: str, text: Any) -> str:
    """`label: text` as an indented (verbatim) markdown block, the text's lines aligned under its first."""
    lines = _clip(text).split("\n")
    head = f"{label}:".ljust(12)
    return "\n".join(f"    {head if i == 0 else ' ' * len(head)}{line}" for i, line in enumerate(lines))


def samples_markdown(step: int, rows: Sequence[Mapping[str, Any]]) -> str:
    """A few trajectory rows as markdown for TensorBoard's Text tab (prompt, completion, answer verbatim)."""
    parts = []
    for r in rows:
        reward = r.get("reward")
        reward_s = f"{reward:.4g}" if isinstance(reward, (int, float)) else "-"
        head = f"**reward {reward_s}** · task `{r.get('task_id')}` sample {r.get('sample_index')}"
        if r.get("finish_reason") == "length":
            head += " · cut at max_new_tokens"
        parts.append(head + "\n\n" + "\n".join((_block("prompt", r.get("prompt")),
                                                _block("completion", r.get("completion")),
                                                _block("answer", r.get("answer")))))
    return f"step {step}\n\n" + "\n\n---\n\n".join(parts)


class RunReporter:
    """The run log, the progress line, the plots and optional W&B of one run (see the module docstring).

    wandb: None (off) or the keyword arguments of `WandbLog` (project, name, mode); `config` is the resolved
    run config it records. Raises `WandbMissing` (one line) when asked for W&B without the package installed.
    """

    def __init__(self, run_dir: str | Path, total_steps: int, *, resume: bool = False,
                 stream: TextIO | None | Literal["stderr"] = "stderr", tty: bool | None = None,
                 wandb: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
                 tensorboard: bool = True, samples_per_log: int = 4, samples_every_s: float = 60.0,
                 throughput_window: int = 20, plot_every_s: float = 60.0, log_interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = Path(run_dir)
        self.total_steps = int(total_steps)
        self.samples_per_log, self.samples_every_s = samples_per_log, float(samples_every_s)
        self._clock = clock
        self.progress = Progress(total_steps, stream, tty=tty, clock=clock, log_interval_s=log_interval_s)
        self.wandb = None
        if wandb is not None:
            from moerl.runlog.wandb_log import WandbLog  # imports wandb: only when asked for

            self.wandb = WandbLog(self.run_dir, resume=resume, config=config, **dict(wandb))
        self.log = RunLog(self.run_dir, resume=resume, tensorboard=tensorboard)
        self.plots = PlotWriter(self.run_dir, every_s=plot_every_s) if plot_every_s > 0 else None
        if self.plots is not None:
            self.plots.start()  # loads matplotlib (a fresh machine builds its font cache) while the run starts
        self._window: collections.deque[tuple[float, float, float]] = collections.deque(maxlen=throughput_window + 1)
        self._rl_t0: float | None = None
        self._samples_total = 0.0
        self._last_text: float | None = None
        self._closed = False
        self._finished_at: float | None = None
        self.events: list[tuple[str, str]] = []  # (kind, text) of every event, in order
        self.close_s: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------ start-up
    def stage(self, text: str) -> None:
        """A line saying what the run does now: `[0:00:04] starting 2 rollout workers`."""
        self.progress.stage(redact(text))

    def warm_start(self, index: int, total: int, metrics: Mapping[str, Any]) -> None:
        """Supervised warm-start step `index` (0-based) of `total`: logged as step index - total (negative)."""
        row = self.log.log_step(index - total, scalars(metrics, "sft/"))
        if self.wandb is not None:
            self.wandb.log(row["step"], row)
        self.progress.warm_start(index + 1, total, metrics)

    def begin_rl(self) -> None:
        """The RL steps start now: the throughput of the first steps is counted from here."""
        self._rl_t0 = self._clock()
        self._window.clear()
        self._window.append((self._rl_t0, 0.0, 0.0))

    # ------------------------------------------------------------------------------------------ steps
    def step(self, step: int, metrics: dict[str, Any], rows: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
        """Log RL step `step`: `metrics` (its expert counts are taken out) and its trajectory rows. Returns
        the metrics row written."""
        if self._rl_t0 is None:
            self.begin_rl()
        for source, key in (("rollout", "expert_counts_rollout"), ("trainer", "expert_counts")):
            counts = metrics.pop(key, None)
            if counts is not None:
                self.log.log_expert_load(step, source, counts)
        values = scalars(metrics)
        values.update(self._throughput(values))
        row = self.log.log_step(step, values)
        self.log.log_trajectories(rows)
        if self.wandb is not None:
            self.wandb.log(step, row)
        self._maybe_log_samples(step, rows)
        self.progress.update(step, values)
        return row

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """A metrics row of its own at `step` (an eval's results, at the step whose weights it evaluated):
        metrics.jsonl, TensorBoard and W&B, not the progress line."""
        row = self.log.log_step(step, metrics)
        if self.wandb is not None:
            self.wandb.log(step, row)
        return row

    def _throughput(self, values: Mapping[str, float]) -> dict[str, float]:
        """Samples and completion tokens trained per second over the last steps (the window), and the
        samples per second since the RL steps began."""
        now = self._clock()
        samples, tokens = values.get("samples", 0.0), values.get("tokens", 0.0)
        _, prev_samples, prev_tokens = self._window[-1]
        self._window.append((now, prev_samples + samples, prev_tokens + tokens))
        self._samples_total += samples
        t0, s0, k0 = self._window[0]
        dt = now - t0
        out = {}
        if dt > 0:
            out[SAMPLES_PER_S_KEY] = (prev_samples + samples - s0) / dt
            if "tokens" in values:
                out[TOKENS_PER_S_KEY] = (prev_tokens + tokens - k0) / dt
        if self._rl_t0 is not None and now > self._rl_t0:
            out[SAMPLES_PER_S_AVG_KEY] = self._samples_total / (now - self._rl_t0)
        return out

    def _maybe_log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        now = self._clock()
        due = self._last_text is None or now - self._last_text >= self.samples_every_s or step >= self.total_steps
        if not rows or not due or self.samples_per_log <= 0:
            return
        self._last_text = now
        picked = pick_samples(rows, self.samples_per_log)
        self.log.log_text(step, "samples", samples_markdown(step, picked))
        if self.wandb is not None:
            self.wandb.log_samples(step, picked)

    # ------------------------------------------------------------------------------------------ events
    def event(self, kind: str, text: str) -> None:
        """Something that happened (a checkpoint saved, a worker lost or started, an eval done, a warning),
        printed as a line of its own. The hook given to the Ray parts: `on_event=report.event`. Secrets are
        masked (moerl/redact.py): an error's text may hold what a storage client or a reward was given."""
        text = redact(text)
        self.events.append((kind, text))
        self.progress.stage(f"warning: {text}" if kind == "warning" else text)
        if kind == "warning":  # kept where a failed run's traceback goes, so no warning is seen only in passing
            try:
                with open(self.run_dir / "error.log", "a") as f:
                    f.write(f"[{format_duration(self.progress.elapsed())}] warning: {text}\n")
            except OSError:
                pass

    # ------------------------------------------------------------------------------------------ the end
    def finish(self) -> None:
        """The run is over: end the progress line, close the run log and TensorBoard, and start writing the
        final plots in the background (the caller can shut Ray down meanwhile). Idempotent, never raises."""
        if self._finished_at is not None:
            return
        self._finished_at = time.monotonic()
        steps = [("progress", self.progress.close), ("run log", self.log.close)]
        if self.plots is not None:
            steps.append(("plots", self.plots.finish))
        self._run_steps(steps)

    def close(self) -> dict[str, float]:
        """`finish()`, then wait for the final plots and finish W&B. Prints and returns how long each part
        took (seconds; "total" from `finish()` on). Idempotent, never raises."""
        self.finish()
        if self._closed:
            return self.close_s
        self._closed = True
        steps: list[tuple[str, Callable[[], Any]]] = []
        if self.plots is not None:
            steps.append(("plots", self.plots.close))
        if self.wandb is not None:
            steps.append(("wandb", self.wandb.finish))
        self._run_steps(steps)
        if self.plots is not None:
            self.close_s["plots"] = self.plots.render_s  # the final render, on its thread or here
            for problem in self.plots.problems:  # a line of ours, not Python's raw warning with its source line
                self.event("warning", problem)
        self.close_s["total"] = time.monotonic() - self._finished_at
        detail = ", ".join(f"{k} {v:.1f} s" for k, v in self.close_s.items() if k != "total" and v >= 0.05)
        self.progress.message(f"[{format_duration(self.progress.elapsed())}] outputs in {self.run_dir} "
                              f"(closed in {self.close_s['total']:.1f} s{': ' + detail if detail else ''})")
        return self.close_s

    def _run_steps(self, steps: list[tuple[str, Callable[[], Any]]]) -> None:
        """Each step runs even when one before it fails; a failure is a warning, never an exception."""
        for what, step in steps:
            t0 = time.monotonic()
            try:
                step()
            except Exception as e:  # noqa: BLE001 - the run's outcome (or its exception) is what matters here
                cause = str(e) if isinstance(e, DiskWriteError) else f"{type(e).__name__}: {e}"
                self.event("warning", f"{what} not closed cleanly: {cause}")
            self.close_s[what] = self.close_s.get(what, 0.0) + time.monotonic() - t0

    def __enter__(self) -> RunReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
