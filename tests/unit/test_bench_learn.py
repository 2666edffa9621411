"""`moerl bench learn`'s reading of a run (moerl/bench/learn.py): the accuracy curve against RL wall time (an eval
at step s counts when step s ended), time to each level, and the verdict lines of its table."""

from __future__ import annotations

import json
from pathlib import Path

from moerl.bench.learn import read_run, table, time_to


def _write_run(path: Path, accuracies: dict[int, float], entropy: float, all_equal: float) -> Path:
    path.mkdir(parents=True)
    rows = [{"step": 0, "time": 40.0, "eval/reward": accuracies[0]}]  # before training, after start-up
    for step in range(1, 21):
        rows.append({"step": step, "time": 50.0 + 2.0 * step, "time/step_s": 2.0, "samples": 128,
                     "is/behaviour_kl": 1e-3 * step, "policy/entropy": entropy, "reward/all_equal_frac": all_equal})
        if step in accuracies:
            rows.append({"step": step, "time": 60.0 + 2.0 * step, "eval/reward": accuracies[step]})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_curve_is_timed_by_the_step_whose_weights_were_evaluated(tmp_path: Path) -> None:
    run = read_run(_write_run(tmp_path / "a", {0: 0.1, 5: 0.15, 10: 0.32, 20: 0.45}, 0.8, 0.2))
    # RL starts when step 1 starts (t = 50); step 10 ended at 70: 20 s of RL, not the eval row's 80
    assert run["curve"] == [(0.0, 0.1), (10.0, 0.15), (20.0, 0.32), (40.0, 0.45)]
    assert run["steps"] == 20 and run["wall_s"] == 40.0 and abs(run["samples_per_s"] - 20 * 128 / 40) < 1e-9
    assert abs(run["kl_max"] - 0.02) < 1e-12
    assert time_to(run["curve"], 0.3) == 20.0 and time_to(run["curve"], 0.5) is None


def test_table_names_levels_not_reached_and_a_collapsed_policy(tmp_path: Path) -> None:
    a = read_run(_write_run(tmp_path / "a", {0: 0.1, 10: 0.05, 20: 0.05}, 1e-4, 1.0))
    s = read_run(_write_run(tmp_path / "s", {0: 0.1, 10: 0.25, 20: 0.3}, 0.7, 0.3))
    text = table({"async": a, "sync": s}, 0.1, [0.1, 0.3])
    assert "RL time to warm start + 0.1" in text
    assert "not reached within the run: +0.1: async not reached" in text
    assert "not reached within the run: +0.3: async not reached, sync not reached" in text
    lines = text.splitlines()
    assert any(l.startswith("async collapsed") for l in lines) and not any(l.startswith("sync collapsed") for l in lines)
    assert "every step of every mode under the bound" in text
