"""`moerl bench learn`'s reading of its runs: each run's curves from its metrics.jsonl, each arm's statistics over
seeds, the table against sync, and learn.png (the curves with their spread).

Times are RL wall time: RL starts when its first step starts; an eval at step s scores the weights that existed
when step s ended, so it is timed there (not when the eval row was written). Time to an accuracy is the first eval
at or over it. A run's final accuracy is the mean of its last `FINAL_EVALS` evals (one eval of a policy that still
moves is noisy: on the CPU shape successive evals of one run differ by up to 0.2). Each arm's run of a seed is
timed to that seed's sync final accuracy (the seed's arms share one warm start), and its speed-up is sync's own
time to it over the arm's: VCPO's measure of an asynchronous speed-up.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from moerl.runlog.run_log import read_jsonl

COLLAPSE_ENTROPY = 0.05  # nats per token: the last steps' entropy under this (and no accuracy gained) is a collapse
COLLAPSE_DROP = 0.05  # or a final held-out accuracy this far under the warm start's
FINAL_EVALS = 3  # a run's final accuracy: the mean of its last this many evals


def final_accuracy(run: dict) -> float:
    """The mean held-out accuracy of the run's last FINAL_EVALS evals after the step-0 one (or the step-0 one alone)."""
    tail = run["curve"][1:][-FINAL_EVALS:] or run["curve"][:1]
    return sum(acc for _, _, acc in tail) / len(tail)


def read_run(run_dir: Path) -> dict:
    """One run: `curve` [(RL seconds, step, held-out accuracy)], `train` [(RL seconds, step, train reward)], its
    rates and its health (entropy, ESS, clip fraction, behaviour KL, groups without signal)."""
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0 and "time/step_s" in r]
    evals = [r for r in rows if "eval/reward" in r]
    t0 = steps[0]["time"] - steps[0]["time/step_s"] if steps else 0.0
    ended = {r["step"]: r["time"] - t0 for r in steps}
    curve = [(0.0 if e["step"] == 0 else ended.get(e["step"], math.nan), e["step"], e["eval/reward"]) for e in evals]
    curve = sorted(c for c in curve if not math.isnan(c[0]))
    wall = steps[-1]["time"] - t0 if steps else 0.0
    tail = steps[-max(1, len(steps) // 10):]  # the last tenth of the run

    def mean(rows: list[dict], key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else math.nan

    kl = sorted(r.get("is/behaviour_kl", 0.0) for r in steps) or [0.0]
    ess = sorted(r["is/ess"] for r in steps if "is/ess" in r) or [math.nan]
    return {"curve": curve, "train": [(ended[r["step"]], r["step"], r.get("reward/mean", math.nan)) for r in steps],
            "steps": len(steps), "wall_s": wall, "samples_per_s": sum(r.get("samples", 0) for r in steps) / max(wall, 1e-9),
            "train_reward_last": mean(tail, "reward/mean"), "kl_median": kl[len(kl) // 2], "kl_max": kl[-1],
            "entropy_first": mean(steps[:10], "policy/entropy"), "entropy_last": mean(tail, "policy/entropy"),
            "all_equal_last": mean(tail, "reward/all_equal_frac"), "ess_min": ess[0], "ess_median": ess[len(ess) // 2],
            "clip_frac": mean(steps, "policy/clip_frac"), "staleness": mean(steps, "staleness/mean")}


def time_to(curve: list[tuple[float, int, float]], accuracy: float) -> float | None:
    """RL wall time of the first eval at or over `accuracy` (None: never within the run)."""
    return next((t for t, _, acc in curve if acc >= accuracy - 1e-9), None)


def collapsed(run: dict) -> bool:
    start, end = run["curve"][0][2], final_accuracy(run)
    return end < start - COLLAPSE_DROP or (run["entropy_last"] < COLLAPSE_ENTROPY and end <= start)


def arm_stats(runs: list[dict], sync_final: dict | None, levels: list[float]) -> dict:
    """One arm over its seeds: medians and ranges of accuracies and times (None = not reached by that seed).
    `sync_final`: seed -> that seed's sync final accuracy (each seed's arms share its warm start, so each is timed
    to its own seed's sync), "median" -> the median over seeds for a seed that sync did not run."""
    start = [r["curve"][0][2] for r in runs]
    final = [final_accuracy(r) for r in runs]
    out = {"seeds": len(runs), "start": start, "final": final, "gain": [f - s for f, s in zip(final, start)],
           "train_reward": [r["train_reward_last"] for r in runs], "samples_per_s": [r["samples_per_s"] for r in runs],
           "entropy_last": [r["entropy_last"] for r in runs], "ess_min": [r["ess_min"] for r in runs],
           "clip_frac": [r["clip_frac"] for r in runs], "kl_max": [r["kl_max"] for r in runs],
           "staleness": [r["staleness"] for r in runs], "collapsed": sum(collapsed(r) for r in runs)}
    out["levels"] = {level: [time_to(r["curve"], s + level) for r, s in zip(runs, start)] for level in levels}
    if sync_final is not None:
        out["to_sync_final"] = [time_to(r["curve"], sync_final.get(r.get("seed"), sync_final["median"])) for r in runs]
    return out


def summarize(runs: dict[str, list[dict]], levels: list[float]) -> dict[str, dict]:
    """Every arm's statistics; sync's final accuracy (if sync ran) is the target every arm is timed to."""
    sync_final = None
    if runs.get("sync"):
        sync_final = {r.get("seed"): final_accuracy(r) for r in runs["sync"]}
        sync_final["median"] = statistics.median(final_accuracy(r) for r in runs["sync"])
    stats = {arm: arm_stats(rs, sync_final, levels) for arm, rs in runs.items()}
    if sync_final is not None:
        base = {r.get("seed"): t for r, t in zip(runs["sync"], stats["sync"]["to_sync_final"])}
        for arm, rs in runs.items():  # per seed: sync's time to its own final over the arm's
            stats[arm]["speedup"] = [base[r.get("seed")] / t if t and base.get(r.get("seed")) else None
                                     for r, t in zip(rs, stats[arm]["to_sync_final"])]
            stats[arm]["sync_final"] = sync_final["median"]
    return stats


def _spread(values: list[float | None], spec: str = ".3f", unit: str = "") -> str:
    """`median [min, max]` of the values reached; `n/N` when some seeds never reached it."""
    got = [v for v in values if v is not None and not math.isnan(v)]
    if not got:
        return "-"
    text = f"{statistics.median(got):{spec}}{unit}"
    if len(got) > 1:
        text += f" [{min(got):{spec}}, {max(got):{spec}}]"
    if len(got) < len(values):
        text += f" ({len(got)}/{len(values)} seeds)"
    return text


def table(stats: dict[str, dict], levels: list[float], warm: dict[int, float] | None = None) -> str:
    """Arms as columns, sync first (the peer every other arm is compared with); median [min, max] over seeds."""
    arms = sorted(stats, key=lambda a: (a != "sync", a))
    rows: list[tuple[str, list[str]]] = [
        ("seeds", [str(stats[a]["seeds"]) for a in arms]),
        ("held-out accuracy before RL", [_spread(stats[a]["start"]) for a in arms]),
        (f"held-out accuracy at the end (last {FINAL_EVALS} evals)", [_spread(stats[a]["final"]) for a in arms]),
        ("gain over the warm start", [_spread(stats[a]["gain"], "+.3f") for a in arms]),
        ("train reward, last tenth of steps", [_spread(stats[a]["train_reward"]) for a in arms]),
    ]
    sync_final = stats[arms[0]].get("sync_final")
    if sync_final is not None:
        rows.append((f"RL s to its seed's sync final accuracy (median {sync_final:.3f})",
                     [_spread(stats[a]["to_sync_final"], ".0f", " s") for a in arms]))
        rows.append(("  speed-up over sync, per seed", [_spread(stats[a]["speedup"], ".2f", "x") for a in arms]))
    for level in levels:
        rows.append((f"RL s to warm start + {level:g}", [_spread(stats[a]["levels"][level], ".0f", " s") for a in arms]))
    rows += [("throughput, samples/s", [_spread(stats[a]["samples_per_s"], ".0f") for a in arms]),
             ("staleness, mean", [_spread(stats[a]["staleness"], ".2f") for a in arms]),
             ("policy entropy, last tenth (nats)", [_spread(stats[a]["entropy_last"], ".3g") for a in arms]),
             ("ESS of the IS weights, worst step", [_spread(stats[a]["ess_min"], ".3f") for a in arms]),
             ("clip fraction, mean", [_spread(stats[a]["clip_frac"], ".3f") for a in arms]),
             ("behaviour KL, worst step (nats)", [_spread(stats[a]["kl_max"], ".3g") for a in arms]),
             ("collapsed runs", [f"{stats[a]['collapsed']}/{stats[a]['seeds']}" for a in arms])]
    header = ["metric (median [min, max] over seeds)", *arms]
    widths = [max(len(header[i]), *(len(r[0] if i == 0 else r[1][i - 1]) for r in rows)) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = ["", "learning: held-out accuracy (problems never trained on) against RL wall time; peer column: sync",
             fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(name, *cells) for name, cells in rows]
    if warm:
        lines.append("warm starts (held-out accuracy, in-process): " +
                     ", ".join(f"seed {s}: {a:.3f}" for s, a in sorted(warm.items())))
    for arm in arms:
        if stats[arm]["collapsed"]:
            lines.append(f"{arm}: {stats[arm]['collapsed']} of {stats[arm]['seeds']} runs collapsed (final held-out "
                         f"accuracy under the warm start's, or entropy under {COLLAPSE_ENTROPY} without a gain)")
    return "\n".join(lines)


def _band(curves: list[list[tuple[float, float]]], grid: list[float]) -> tuple[list[float], list[float], list[float]]:
    """Mean, min and max over runs of step-function curves [(x, y)] on a common grid (a run's value at x is its
    last point at or before x; grid points past a run's end are left out for it)."""
    mean, lo, hi = [], [], []
    for x in grid:
        ys = [next((y for cx, y in reversed(c) if cx <= x), c[0][1]) for c in curves if c and c[-1][0] >= x]
        mean.append(sum(ys) / len(ys) if ys else math.nan)
        lo.append(min(ys) if ys else math.nan)
        hi.append(max(ys) if ys else math.nan)
    return mean, lo, hi


def plot(runs: dict[str, list[dict]], path: Path, title: str = "") -> None:
    """Three panels, each arm's mean over seeds with its min-max band: the held-out accuracy's gain over the run's
    warm start against RL wall time and against RL steps, and train reward (mean of 10-step windows) against RL
    steps. Gains, not accuracies: every seed has its own warm start (0.31 to 0.48 on the CPU shape), which would
    hide the arms' differences in the seeds' spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for i, (arm, rs) in enumerate(sorted(runs.items(), key=lambda kv: (kv[0] != "sync", kv[0]))):
        color = f"C{i}"
        panels = [([[(t, a - r["curve"][0][2]) for t, _, a in r["curve"]] for r in rs], axes[0]),
                  ([[(s, a - r["curve"][0][2]) for _, s, a in r["curve"]] for r in rs], axes[1]),
                  ([_windows(r["train"]) for r in rs], axes[2])]
        for curves, ax in panels:
            end = max((c[-1][0] for c in curves if c), default=0.0)
            grid = [end * j / 200 for j in range(201)]
            mean, lo, hi = _band(curves, grid)
            ax.plot(grid, mean, color=color, label=f"{arm} ({len(rs)} seed{'s' * (len(rs) > 1)})")
            ax.fill_between(grid, lo, hi, color=color, alpha=0.18, lw=0)
    for ax, xlabel, ylabel in zip(axes, ("RL wall time (s)", "RL step", "RL step"),
                                  ("held-out accuracy gain over the warm start", "held-out accuracy gain over the warm start",
                                   "train reward (mean of 10 steps)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in axes[:2]:
        ax.axhline(0.0, color="grey", lw=0.8, ls=":")
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "moerl bench learn: mean over seeds, band = min..max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _windows(train: list[tuple[float, int, float]], size: int = 10) -> list[tuple[float, float]]:
    return [(train[i + size - 1][1], sum(r for _, _, r in train[i: i + size]) / size)
            for i in range(0, len(train) - size + 1, size)]
