"""PNG plots of a run, from `<run_dir>/metrics.jsonl` and `<run_dir>/expert_load.json`.

    reward.png               reward/mean per step, its rolling mean, eval/reward when logged
    episodes.png             multi-turn tasks: turns, tool calls and errors, observation vs model tokens, cut, failed
    throughput.png           samples/s and tokens/s over a window of recent steps (from each row's `time`, `samples`
                             and `tokens`), the run's average dashed; staleness below
    step_time.png            each step's wall time by the controller's phases, in percent (moerl/loop/phases.py)
    expert_load_rollout.png  heatmap layers x experts: fraction of routed tokens per expert
    expert_load_trainer.png  the same for the trainer's forward passes

matplotlib is imported lazily and used without pyplot (Agg canvas, no global backend change), so this
runs headless and from any thread. A plot whose data is missing is skipped; a step logged twice (a
resumed run redoing steps) counts with its last values. Files are replaced atomically.

`PlotWriter` writes them on a background thread while the run goes on (and loads matplotlib, building its
font cache on a fresh machine, while the run starts), so that the end of a run only renders the last state.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from moerl.runlog.disk import cause_of, replace_atomically
from moerl.runlog.run_log import EXPERT_LOAD_SOURCES, METRICS_FILE, STEP_PHASES, read_expert_load, read_jsonl

REWARD_KEY = "reward/mean"
EVAL_REWARD_KEY = "eval/reward"
SAMPLES_PER_S_KEY = "throughput/samples_per_s"
TOKENS_PER_S_KEY = "throughput/tokens_per_s"
STALENESS_KEY = "staleness/mean"
STALENESS_MAX_KEY = "staleness/max"
SAMPLES_KEY = "samples"  # samples trained in the step
TOKENS_KEY = "tokens"  # completion tokens trained in the step

_DPI = 110


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write the run's PNG plots into `run_dir`; returns the paths written (those with data)."""
    run_dir = Path(run_dir)
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        warnings.warn(f"plots skipped: {e} (pip install matplotlib)", stacklevel=2)
        return []
    rows = _metric_rows(run_dir)
    load = read_expert_load(run_dir)
    jobs: list[tuple[str, Callable[[], Any]]] = [
        ("reward.png", lambda: _reward_figure(rows, run_dir.name)),
        ("throughput.png", lambda: _throughput_figure(rows, run_dir.name)),
        ("step_time.png", lambda: _step_time_figure(rows, run_dir.name)),
        ("episodes.png", lambda: _episodes_figure(rows, run_dir.name)),
    ]
    for source in EXPERT_LOAD_SOURCES:
        jobs.append((f"expert_load_{source}.png", lambda s=source: _expert_load_figure(load, s, run_dir.name)))
    written, failed = [], {}  # failed: cause -> plots (a full disk fails them all alike: said once)
    for name, make in jobs:
        try:
            fig = make()
            if fig is None:
                continue
            path = run_dir / name
            _save(fig, path)
            written.append(path)
        except Exception as e:  # noqa: BLE001 - a plot must not fail the run
            cause = cause_of(e, run_dir) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            failed.setdefault(cause, []).append(name)
    for cause, names in failed.items():
        warnings.warn(f"plot{'s' * (len(names) > 1)} {', '.join(names)} not written in {run_dir}: {cause}",
                      stacklevel=2)
    return written


# ------------------------------------------------------------------------------------------------ data


def _metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows sorted by step; the lines of one step merged, a later line's value winning (an eval
    logs its own line at the step it evaluated). A step's `time` is that of its training line (the one with
    `samples`): an eval's line, logged later, must not move it (the throughput plot divides by it)."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(run_dir / METRICS_FILE, strict=False, missing_ok=True):
        step = row.get("step")
        if isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step):
            merged = by_step.setdefault(int(step), {})
            if "time" in merged and SAMPLES_KEY not in row:
                row = {k: v for k, v in row.items() if k != "time"}
            merged.update(row)
    return [by_step[s] for s in sorted(by_step)]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]] | None:
    """(steps, values) of `key`, NaN where a row has null; None when no row has a finite value."""
    steps, values = [], []
    for row in rows:
        if key not in row:
            continue
        v = row[key]
        v = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        steps.append(int(row["step"]))
        values.append(v)
    if not any(math.isfinite(v) for v in values):
        return None
    return steps, values


def _rolling_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over the finite values of the last `window` points (NaN if none)."""
    out = []
    for i in range(len(values)):
        vals = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def _rolling_max(values: list[float], window: int) -> list[float]:
    """Trailing max over the finite values of the last `window` points (NaN if none)."""
    out = []
    for i in range(len(values)):
        vals = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(max(vals) if vals else math.nan)
    return out


# ----------------------------------------------------------------------------------------------- plots


def _new_figure(width: float, height: float, nrows: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def _style_step_axis(ax: Any, steps: list[int]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if steps and max(steps) - min(steps) < 2:  # one or two steps: whole-number ticks around them
        ax.set_xlim(min(steps) - 1, max(steps) + 1)
    ax.grid(True, alpha=0.3)


def _all_steps(*series: tuple[list[int], list[float]] | None) -> list[int]:
    return [step for s in series if s is not None for step in s[0]]


def _marker(n: int) -> str | None:
    return "o" if n <= 30 else None


def _reward_figure(rows: list[dict[str, Any]], run_name: str) -> Any:
    reward = _series(rows, REWARD_KEY)
    evals = _series(rows, EVAL_REWARD_KEY)
    if reward is None and evals is None:
        return None
    fig, (ax,) = _new_figure(8, 4.5)
    if reward is not None:
        steps, values = reward
        n = len(steps)
        window = max(2, min(25, n // 10))
        if n >= 5:
            ax.plot(steps, values, color="tab:blue", alpha=0.35, lw=1, marker=_marker(n), ms=3,
                    label="reward/mean")
            ax.plot(steps, _rolling_mean(values, window), color="tab:blue", lw=2,
                    label=f"rolling mean ({window} steps)")
        else:
            ax.plot(steps, values, color="tab:blue", lw=1.5, marker="o", ms=5, label="reward/mean")
    if evals is not None:
        steps, values = evals
        ax.plot(steps, values, color="tab:orange", lw=1.5, marker="s", ms=5, label="eval/reward")
    ax.set_title(f"Reward — {run_name}")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    _style_step_axis(ax, _all_steps(reward, evals))
    ax.legend(loc="best", fontsize=9)
    return fig


def throughput_window(n: int) -> int:
    """Steps the throughput plot averages over, for a run of `n` logged steps: a twentieth of it, 5 to 50."""
    return max(5, min(50, n // 20))


def _windowed_rate(rows: list[dict[str, Any]], key: str, window: int) -> tuple[list[int], list[float], float] | None:
    """(steps, rate over the last `window` steps, the run's average rate) of a per-step count `key`, from the
    rows' `time` (the time a step was logged). A step's rate: its count and the previous window-1 steps' counts
    over the time since the step before them; the first row only starts the clock."""
    points = [(int(r["step"]), float(r["time"]), r.get(key)) for r in rows
              if r.get("step", 0) > 0 and isinstance(r.get("time"), (int, float))]
    if len(points) < 2 or not any(isinstance(c, (int, float)) and not isinstance(c, bool) for _, _, c in points[1:]):
        return None
    counts = [float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) else 0.0
              for _, _, c in points]
    steps, rates = [], []
    for i in range(1, len(points)):
        j = max(0, i - window)
        dt = points[i][1] - points[j][1]
        steps.append(points[i][0])
        rates.append(sum(counts[j + 1: i + 1]) / dt if dt > 0 else math.nan)
    total_dt = points[-1][1] - points[0][1]
    average = sum(counts[1:]) / total_dt if total_dt > 0 else math.nan
    if not any(math.isfinite(r) for r in rates):
        return None
    return steps, rates, average


def _throughput_figure(rows: list[dict[str, Any]], run_name: str) -> Any:
    window = throughput_window(sum(1 for r in rows if r.get("step", 0) > 0))  # RL steps (not the warm start's)
    panels = []
    for key, metric, label, color in ((SAMPLES_KEY, SAMPLES_PER_S_KEY, "samples/s", "tab:green"),
                                      (TOKENS_KEY, TOKENS_PER_S_KEY, "tokens/s", "tab:purple")):
        rate = _windowed_rate(rows, key, window)
        if rate is None and (logged := _series(rows, metric)) is not None:  # no counts: the rate as logged
            rate = (*logged, math.nan)
        if rate is not None:
            panels.append((rate, label, color))
    if not panels:
        return None
    staleness = _series(rows, STALENESS_KEY)
    staleness_max = _series(rows, STALENESS_MAX_KEY)
    nrows = len(panels) + (staleness is not None or staleness_max is not None)
    fig, axes = _new_figure(8, 2.6 * nrows + 0.6, nrows=nrows)
    all_steps = [s for (steps, _, _), _, _ in panels for s in steps]
    for ax, ((steps, values, average), label, color) in zip(axes, panels):
        ax.plot(steps, values, color=color, lw=1.5, marker=_marker(len(steps)), ms=3,
                label=f"{label}, last {window} steps")
        if math.isfinite(average):
            ax.axhline(average, color=color, lw=1, ls="--", alpha=0.6, label=f"run average {average:.3g}")
        ax.set_ylabel(label, color=color)
        _zero_based(ax, values + [average])
        _style_step_axis(ax, all_steps)
        ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    if nrows > len(panels):
        ax = axes[-1]
        top = 0.0
        if staleness is not None:
            ax.plot(staleness[0], _rolling_mean(staleness[1], window), color="tab:red", lw=1.2,
                    label=f"mean, last {window} steps")
            top = max(top, max(v for v in staleness[1] if math.isfinite(v)))
        if staleness_max is not None:
            ax.plot(staleness_max[0], _rolling_max(staleness_max[1], window), color="tab:red", lw=0.9, ls=":",
                    label=f"max, last {window} steps")
            top = max(top, max(v for v in staleness_max[1] if math.isfinite(v)))
        ax.set_ylim(0, max(top, 1.0) * 1.15)  # a flat line at the maximum stays inside the frame
        ax.set_ylabel("staleness\n(policy versions)", color="tab:red")
        _style_step_axis(ax, all_steps + _all_steps(staleness, staleness_max))
        ax.legend(loc="best", fontsize=8, framealpha=0.9)
    axes[0].set_title(f"Throughput over the last {window} steps — {run_name}")
    axes[-1].set_xlabel("trainer step")
    return fig


def _zero_based(ax: Any, values: list[float]) -> None:
    """y from 0 to 15% above the largest value: a flat line is drawn inside the frame, never on its edge."""
    finite = [v for v in values if math.isfinite(v)]
    top = max(finite, default=0.0)
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)


def _step_time_figure(rows: list[dict[str, Any]], run_name: str) -> Any:
    """Each step's wall time split by phase, in percent (rolling mean): where the loop's time goes, as it goes.
    The first step (start-up, the first weights) is left out: it would dwarf the rest."""
    timed = [r for r in rows if r.get("step", 0) > 0 and isinstance(r.get("time/step_s"), (int, float))
             and r["time/step_s"] > 0][1:]
    if len(timed) < 2:
        return None
    steps = [int(r["step"]) for r in timed]
    window = max(1, len(steps) // 50)
    layers = [(label, _rolling_mean([100 * float(r.get(f"time/{p}_s") or 0.0) / r["time/step_s"] for r in timed],
                                    window)) for p, _, label in STEP_PHASES]
    layers = [(label, values) for label, values in layers if max(values) > 0]
    median_ms = 1e3 * sorted(r["time/step_s"] for r in timed)[len(timed) // 2]
    fig, (ax,) = _new_figure(8, 3.6)
    ax.stackplot(steps, *[v for _, v in layers], labels=[label for label, _ in layers], alpha=0.85)
    ax.set_ylabel("% of the step's wall time")
    ax.set_ylim(0, 100)
    _style_step_axis(ax, steps)
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    ax.set_title(f"Where each step's time goes (median step {median_ms:.0f} ms) — {run_name}")
    ax.set_xlabel("trainer step")
    return fig


EPISODE_PANELS = (("episode/turns_mean", "turns per episode"), ("episode/tool_calls_mean", "tool calls per episode"),
                  ("episode/tool_error_frac", "tool errors per call"),
                  ("episode/obs_tokens_mean", "observation tokens per episode"),
                  ("episode/model_tokens_mean", "model tokens per episode"),
                  ("episode/cut_turns", "episodes cut by max_turns"), ("episode/cut_tokens", "cut by max_episode_tokens"),
                  ("episode/failed", "episodes failed"))


def _episodes_figure(rows: list[dict[str, Any]], run_name: str) -> Any:
    """Multi-turn tasks only (metrics episode/*): turns, tool calls and errors, tokens, cut and failed episodes."""
    panels = [(series, label) for key, label in EPISODE_PANELS if (series := _series(rows, key)) is not None]
    if not panels:
        return None
    fig, axes = _new_figure(8, 1.6 * len(panels), nrows=len(panels))
    for ax, ((steps, values), label) in zip(axes, panels):
        ax.plot(steps, values, lw=0.8, alpha=0.5)
        ax.plot(steps, _rolling_mean(values, max(1, len(steps) // 20)), lw=1.5)
        ax.set_ylabel(label, fontsize=8)
        _style_step_axis(ax, steps)
    axes[0].set_title(f"Episodes — {run_name}")
    axes[-1].set_xlabel("trainer step")
    return fig


def _expert_load_figure(load: dict[str, Any] | None, source: str, run_name: str) -> Any:
    if not load:
        return None
    windows = [w for w in load.get(source) or [] if isinstance(w, dict) and w.get("counts")]
    if not windows:
        return None
    shape = windows[-1].get("shape") or [len(windows[-1]["counts"]), len(windows[-1]["counts"][0])]
    windows = [w for w in windows if (w.get("shape") or [len(w["counts"]), len(w["counts"][0])]) == shape]
    num_layers, num_experts = shape
    totals = [[0.0] * num_experts for _ in range(num_layers)]
    for w in windows:
        for acc, row in zip(totals, w["counts"]):
            for e, c in enumerate(row):
                acc[e] += float(c)
    frac = []
    for row in totals:
        s = sum(row)
        frac.append([c / s for c in row] if s > 0 else [math.nan] * num_experts)
    if all(math.isnan(row[0]) for row in frac):
        return None
    first = min(int(w["first_step"]) for w in windows)
    last = max(int(w["last_step"]) for w in windows)
    finite_rows = [row for row in frac if not math.isnan(row[0])]
    uniform = 1.0 / num_experts
    imbalance = max(max(row) for row in finite_rows) / uniform  # hottest expert vs an even split

    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import FormatStrFormatter, MaxNLocator

    data = np.ma.masked_invalid(np.array(frac, dtype=float))
    width = min(18.0, max(6.5, 2.5 + 0.11 * num_experts))
    height = min(12.0, max(3.0, 1.6 + 0.3 * num_layers))
    fig, (ax,) = _new_figure(width, height)
    # white = an even split, red = hot experts, blue = cold ones, grey = a layer without tokens
    cmap = colormaps["RdBu_r"].with_extremes(bad="lightgrey")
    # Symmetric around the even split, so hot and cold experts equally far from it look equally strong.
    half = max(float(data.max()) - uniform, uniform - float(data.min()), 0.05 * uniform)
    lo, hi = max(0.0, uniform - half), uniform + half
    norm = TwoSlopeNorm(vmin=lo, vcenter=uniform, vmax=hi)
    im = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    cbar = fig.colorbar(im, ax=ax, pad=0.01, ticks=[lo, (lo + uniform) / 2, uniform, (uniform + hi) / 2, hi])
    cbar.ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    cbar.set_label(f"fraction of routed tokens\n(white = even split, 1/{num_experts})")
    steps = f"step {first}" if first == last else f"steps {first}–{last}"
    ax.set_title(f"Expert load, {source} — {run_name}\n{steps}, hottest expert {imbalance:.2f}x even", fontsize=10)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    for axis, n, max_labels in ((ax.xaxis, num_experts, 32), (ax.yaxis, num_layers, 24)):
        if n <= max_labels:
            axis.set_ticks(range(n))
        else:
            axis.set_major_locator(MaxNLocator(integer=True, nbins=16))
    return fig


def _save(fig: Any, path: Path) -> None:
    replace_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=_DPI))


class PlotWriter:
    """Writes the run's plots on a background thread (see the module docstring).

    The thread first loads matplotlib and renders a throwaway figure (on a fresh machine its font cache is
    built then, which can take tens of seconds), then rewrites the plots every `every_s` seconds while
    metrics.jsonl grows, spending at most about `max_share` of one core on it. `finish()` has it write the
    final plots (after the write in progress, if any) while the caller goes on; `close()` waits for them.
    """

    def __init__(self, run_dir: str | Path, every_s: float = 60.0, max_share: float = 0.05) -> None:
        self.run_dir = Path(run_dir)
        self.every_s, self.max_share = float(every_s), float(max_share)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._final: list[Path] | None = None
        self.problems: list[str] = []  # what the final write could not do (plots not written, and why)
        self.writes = 0  # background writes done, the final one included
        self.render_s = 0.0  # the last write's duration

    def start(self) -> PlotWriter:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moerl-plots", daemon=True)
            self._thread.start()
        return self

    def finish(self) -> None:
        """The run is over: write the final plots, on the thread when it runs (returns at once)."""
        self._stop.set()

    def close(self) -> list[Path]:
        """Wait for the final plots (writing them here when the thread never ran); returns the paths written.
        What they could not do is in `problems`, for the caller to say (as a warning line, not a raw warning)."""
        self.finish()
        if self._thread is not None:
            self._thread.join()
        if self._final is None:
            self._final = self._write()
        return self._final

    def _write(self) -> list[Path]:
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            paths = write_plots(self.run_dir)
        self.writes += 1
        self.render_s = time.monotonic() - t0
        if self._stop.is_set():  # the final write: its problems are said; earlier ones are written over
            self.problems = [str(w.message) for w in caught]
        return paths

    def _run(self) -> None:
        try:
            _warm_up()
        except Exception:  # noqa: BLE001 - matplotlib missing or broken: the final write says so
            return
        seen = None
        interval = self.every_s
        while not self._stop.wait(interval):
            try:
                stat = (self.run_dir / METRICS_FILE).stat()
            except OSError:
                continue
            if (stat.st_size, stat.st_mtime_ns) == seen:
                continue
            seen = (stat.st_size, stat.st_mtime_ns)
            self._write()
            interval = max(self.every_s, self.render_s / max(self.max_share, 1e-3))
        self._final = self._write()


def _warm_up() -> None:
    """Import matplotlib and draw text once: loads (on a fresh machine, builds) the font cache."""
    import io

    fig, (ax,) = _new_figure(1, 1)
    ax.set_title("warm-up")
    fig.savefig(io.BytesIO(), format="png")
