"""The end-of-run summary `moerl train` prints on stdout:

    done: 600 steps in 79 s; outputs in runs/demo; the policy is checkpoint step 600
    reward/mean 0.134 over the first 50 steps, 0.482 over the last 50 (the last step alone: 0.344)
    counters  groups_done     4817  samples_trained  38400  stale_dropped      412
              groups_failed      0  samples_failed       0  ...

The reward is compared over windows of steps, read back from metrics.jsonl (the whole run, a resumed one
included): the last step's value alone is noise (0.344 where the last 50 steps averaged 0.522).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

REWARD_KEY = "reward/mean"
WINDOW = 50  # steps in each reward window (fewer in a short run: at most half its steps)


def step_rewards(metrics_path: Path) -> dict[int, float]:
    """RL step -> reward/mean from metrics.jsonl (line by line; a step logged twice keeps its last row)."""
    out: dict[int, float] = {}
    try:
        with open(metrics_path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash
                step, reward = row.get("step"), row.get(REWARD_KEY)
                if isinstance(step, int) and step >= 1 and isinstance(reward, (int, float)) and math.isfinite(reward):
                    out[step] = float(reward)
    except FileNotFoundError:
        pass
    return out


def reward_line(rewards: Mapping[int, float], window: int = WINDOW) -> str | None:
    """`reward/mean A over the first N steps, B over the last N (the last step alone: C)`; None without rewards."""
    if not rewards:
        return None
    values = [rewards[s] for s in sorted(rewards)]
    n = min(window, max(1, len(values) // 2))
    first, last = sum(values[:n]) / n, sum(values[-n:]) / n
    steps = "step" if n == 1 else f"{n} steps"
    return (f"reward/mean {first:.3f} over the first {steps}, {last:.3f} over the last {n if n > 1 else 'step'}"
            f" (the last step alone: {values[-1]:.3f})")


def counters_table(counters: Mapping[str, int], width: int = 80, indent: str = "counters  ") -> list[str]:
    """The counters as aligned `name value` cells, as many to a line as fit in `width` columns."""
    items = [(str(k), str(v)) for k, v in counters.items()]
    if not items:
        return []
    name_w = max(len(k) for k, _ in items)
    value_w = max(len(v) for _, v in items)
    cells = [f"{k:<{name_w}} {v:>{value_w}}" for k, v in items]
    columns = max(1, (width - len(indent) + 2) // (len(cells[0]) + 2))
    rows = [cells[i:i + columns] for i in range(0, len(cells), columns)]
    return [(indent if i == 0 else " " * len(indent)) + "  ".join(row) for i, row in enumerate(rows)]


def summary(run_dir: Path, steps: int, elapsed_s: float, counters: Mapping[str, int],
            checkpoint_step: int | None = None) -> list[str]:
    """The lines of a finished run's summary (see the module docstring)."""
    lines = [f"done: {steps} steps in {elapsed_s:.0f} s; outputs in {run_dir}"
             + (f"; the policy is checkpoint step {checkpoint_step}" if checkpoint_step is not None else "")]
    reward = reward_line(step_rewards(Path(run_dir) / "metrics.jsonl"))
    if reward:
        lines.append(reward)
    return lines + counters_table(counters)
