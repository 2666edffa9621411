"""`moerl bench learn`'s arithmetic (moerl/bench/learn.py, learn_report.py) on runs with known answers: the curves
timed by the step whose weights were evaluated, each arm's statistics over seeds, the time to sync's final accuracy
and its speed-up, collapse, the arms' overrides, and the report written from the runs in a directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moerl.bench.learn import _parse, arm_overrides, collect, report
from moerl.bench.learn_report import _band, collapsed, read_run, summarize, table, time_to


def _write_run(path: Path, accuracies: dict[int, float], entropy: float = 0.7, all_equal: float = 0.2,
               step_s: float = 2.0) -> Path:
    path.mkdir(parents=True)
    rows = [{"step": 0, "time": 40.0, "eval/reward": accuracies[0]}]  # before training, after start-up
    for step in range(1, 21):
        rows.append({"step": step, "time": 50.0 + step_s * step, "time/step_s": step_s, "samples": 128,
                     "reward/mean": 0.01 * step, "is/behaviour_kl": 1e-3 * step, "policy/entropy": entropy,
                     "reward/all_equal_frac": all_equal, "is/ess": 1.0 - 0.01 * step, "policy/clip_frac": 0.1,
                     "staleness/mean": 1.0})
        if step in accuracies:
            rows.append({"step": step, "time": 60.0 + step_s * step, "eval/reward": accuracies[step]})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_curve_is_timed_by_the_step_whose_weights_were_evaluated(tmp_path: Path) -> None:
    run = read_run(_write_run(tmp_path / "a", {0: 0.1, 5: 0.15, 10: 0.32, 20: 0.45}))
    # RL starts when step 1 starts (t = 50); step 10 ended at 70: 20 s of RL, not the eval row's 80
    assert run["curve"] == [(0.0, 0, 0.1), (10.0, 5, 0.15), (20.0, 10, 0.32), (40.0, 20, 0.45)]
    assert run["steps"] == 20 and run["wall_s"] == 40.0 and abs(run["samples_per_s"] - 20 * 128 / 40) < 1e-9
    assert run["kl_max"] == pytest.approx(0.02) and run["ess_min"] == pytest.approx(0.8)
    assert run["train_reward_last"] == pytest.approx(0.195)  # the last tenth: steps 19 and 20
    assert time_to(run["curve"], 0.3) == 20.0 and time_to(run["curve"], 0.5) is None


def test_time_to_each_seeds_sync_final_accuracy_and_the_speed_up(tmp_path: Path) -> None:
    # a run's final accuracy is the mean of its last 3 evals: sync's seeds end at 0.5, 0.52 and 0.48
    sync = [read_run(_write_run(tmp_path / f"s{i}", {0: 0.3, 5: 0.4, 10: final, 15: final, 20: final})) | {"seed": i}
            for i, final in enumerate((0.5, 0.52, 0.48))]
    fast = [read_run(_write_run(tmp_path / f"a{i}", {0: 0.3, 10: 0.51, 20: 0.55}, step_s=1.0)) | {"seed": i}
            for i in range(3)]
    stats = summarize({"sync": sync, "async": fast}, [0.1, 0.3])
    assert stats["sync"]["final"] == pytest.approx([0.5, 0.52, 0.48]) and stats["sync"]["sync_final"] == 0.5
    assert stats["async"]["final"] == pytest.approx([0.53] * 3)  # its two evals after step 0
    assert stats["sync"]["to_sync_final"] == [20.0, 20.0, 20.0]  # each seed reaches its own final at step 10
    assert stats["async"]["to_sync_final"] == [10.0, 20.0, 10.0]  # seed 1's sync ended at 0.52: async's 0.51 is under
    assert stats["async"]["speedup"] == [2.0, 1.0, 2.0] and stats["sync"]["speedup"] == [1.0] * 3
    slow = [dict(r, curve=r["curve"][:2]) for r in fast]  # stopped at 0.51: seed 1 never reaches its sync's 0.52
    assert summarize({"sync": sync, "async": slow}, [0.1])["async"]["speedup"] == [2.0, None, 2.0]
    assert stats["async"]["levels"][0.1] == [10.0] * 3 and stats["async"]["levels"][0.3] == [None] * 3
    text = table(stats, [0.1, 0.3], warm={0: 0.3, 1: 0.31})
    assert "RL s to its seed's sync final accuracy (median 0.500)" in text
    assert "20 s [20, 20]" in text and "10 s [10, 20]" in text
    assert "2.00x [1.00, 2.00]" in text and "1.00x [1.00, 1.00]" in text
    assert "held-out accuracy at the end" in text and "0.500 [0.480, 0.520]" in text
    assert "warm starts (held-out accuracy, in-process): seed 0: 0.300, seed 1: 0.310" in text


def test_a_collapsed_run_is_counted(tmp_path: Path) -> None:
    down = read_run(_write_run(tmp_path / "d", {0: 0.3, 20: 0.2}))
    flat_and_cold = read_run(_write_run(tmp_path / "c", {0: 0.3, 20: 0.3}, entropy=1e-3))
    fine = read_run(_write_run(tmp_path / "f", {0: 0.3, 20: 0.4}, entropy=1e-3))  # sharp but it learned
    assert [collapsed(r) for r in (down, flat_and_cold, fine)] == [True, True, False]
    text = table(summarize({"stale4/legacy": [down, flat_and_cold, fine]}, [0.1]), [0.1])
    assert "stale4/legacy: 2 of 3 runs collapsed" in text


def test_band_is_the_step_function_mean_min_max():
    curves = [[(0.0, 0.1), (10.0, 0.5)], [(0.0, 0.3), (5.0, 0.2), (20.0, 0.9)]]
    mean, lo, hi = _band(curves, [0.0, 6.0, 10.0, 15.0])
    assert mean == pytest.approx([0.2, 0.15, 0.35, 0.2]) and lo[2] == 0.2 and hi[2] == 0.5
    assert hi[3] == 0.2  # past the first curve's end only the second counts


def test_arms_parse_into_overrides():
    assert arm_overrides("sync") == ["--train.mode=sync"]
    assert arm_overrides("stale2/proximal@train.optim.lr=1e-5;train.minibatches=2")[-2:] == [
        "--train.optim.lr=1e-5", "--train.minibatches=2"]
    assert arm_overrides("async3/m2po") == ["--train.mode=async", "--train.max_staleness=3",
                                            "--train.loss.trust_region=behaviour", "--train.loss.is_correction=m2po"]
    stale = arm_overrides("stale4/legacy")
    assert "--train.forced_staleness=4" in stale and "--train.loss.trust_region=none" in stale
    with pytest.raises(ValueError, match="schedule 'fast'"):
        arm_overrides("fast")
    with pytest.raises(ValueError, match="objective 'magic'"):
        arm_overrides("sync/magic")
    with pytest.raises(SystemExit):
        _parse(["--arms", "sync,bogus"])


def test_report_reads_the_runs_of_a_directory(tmp_path: Path) -> None:
    for seed in (0, 1):
        seed_dir = tmp_path / f"seed{seed}"
        for arm, final in (("sync", 0.4), ("stale2/behaviour", 0.45)):
            run = read_run(_write_run(seed_dir / arm.replace("/", "-"), {0: 0.3, 20: final}))
            (seed_dir / arm.replace("/", "-") / "run.json").write_text(
                json.dumps({"arm": arm, "seed": seed, "overrides": [], "run": run}))
        (seed_dir / "warm.json").write_text(json.dumps({"seed": seed, "accuracy": 0.3}))
    runs, warm = collect(tmp_path)
    assert sorted(runs) == ["stale2/behaviour", "sync"] and len(runs["sync"]) == 2 and warm == {0: 0.3, 1: 0.3}
    text = report(tmp_path, [0.1])
    assert "stale2/behaviour" in text and (tmp_path / "learn.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "learn.json").read_text())["stats"]["sync"]["seeds"] == 2
