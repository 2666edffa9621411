"""PNG plots of a run, from `<run_dir>/metrics.jsonl` and `<run_dir>/expert_load.json`.

    reward.png               reward/mean per step, its rolling mean, eval/reward when logged
    throughput.png           samples/s (+ staleness on a second axis) and tokens/s, when logged
    step_time.png            each step's wall time by the controller's phases, in percent (moerl/loop/phases.py)
    expert_load_rollout.png  heatmap layers x experts: fraction of routed tokens per expert
    expert_load_trainer.png  the same for the trainer's forward passes

matplotlib is imported lazily and used without pyplot (Agg canvas, no global backend change), so this
runs headless and from any thread. A plot whose data is missing is skipped; a step logged twice (a
resumed run redoing steps) counts with its last values. Files are replaced atomically.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable

from moerl.runlog.run_log import EXPERT_LOAD_SOURCES, METRICS_FILE, STEP_PHASES, read_expert_load, read_jsonl

REWARD_KEY = "reward/mean"
EVAL_REWARD_KEY = "eval/reward"
SAMPLES_PER_S_KEY = "throughput/samples_per_s"
TOKENS_PER_S_KEY = "throughput/tokens_per_s"
STALENESS_KEY = "staleness/mean"
STALENESS_MAX_KEY = "staleness/max"

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
    ]
    for source in EXPERT_LOAD_SOURCES:
        jobs.append((f"expert_load_{source}.png", lambda s=source: _expert_load_figure(load, s, run_dir.name)))
    written = []
    for name, make in jobs:
        try:
            fig = make()
            if fig is None:
                continue
            path = run_dir / name
            _save(fig, path)
            written.append(path)
        except Exception as e:  # noqa: BLE001 - a plot must not fail the run
            warnings.warn(f"plot {name} failed: {type(e).__name__}: {e}", stacklevel=2)
    return written


# ------------------------------------------------------------------------------------------------ data


def _metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows sorted by step; the lines of one step merged, a later line's value winning (an eval
    logs its own line at the step it evaluated)."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(run_dir / METRICS_FILE, strict=False, missing_ok=True):
        step = row.get("step")
        if isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step):
            by_step.setdefault(int(step), {}).update(row)
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


def _throughput_figure(rows: list[dict[str, Any]], run_name: str) -> Any:
    samples = _series(rows, SAMPLES_PER_S_KEY)
    tokens = _series(rows, TOKENS_PER_S_KEY)
    panels = [(k, s, label, color) for k, s, label, color in (
        (SAMPLES_PER_S_KEY, samples, "samples/s", "tab:green"),
        (TOKENS_PER_S_KEY, tokens, "tokens/s", "tab:purple"),
    ) if s is not None]
    if not panels:
        return None
    staleness = _series(rows, STALENESS_KEY)
    staleness_max = _series(rows, STALENESS_MAX_KEY)
    fig, axes = _new_figure(8, 3.2 * len(panels) + 0.6, nrows=len(panels))
    for ax, (_, (steps, values), label, color) in zip(axes, panels):
        ax.plot(steps, values, color=color, lw=1.5, marker=_marker(len(steps)), ms=3, label=label)
        ax.set_ylabel(label, color=color)
        ax.set_ylim(bottom=0)
        _style_step_axis(ax, _all_steps(samples, tokens))
    ax0 = axes[0]
    handles, labels = ax0.get_legend_handles_labels()
    if staleness is not None or staleness_max is not None:
        ax2 = ax0.twinx()
        if staleness is not None:
            ax2.plot(*staleness, color="tab:red", lw=1.2, ls="--", marker=_marker(len(staleness[0])), ms=3,
                     label="staleness (mean)")
        if staleness_max is not None:
            ax2.plot(*staleness_max, color="tab:red", lw=0.8, ls=":", alpha=0.7, label="staleness (max)")
        ax2.set_ylabel("staleness (policy versions)", color="tab:red")
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax0.legend(handles, labels, loc="best", fontsize=9)
    ax0.set_title(f"Throughput — {run_name}")
    axes[-1].set_xlabel("trainer step")
    return fig


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
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=_DPI)
    os.replace(tmp, path)
