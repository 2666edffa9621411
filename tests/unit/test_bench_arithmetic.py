"""The numbers `bench loop`, `bench async`, `bench checkpoint` and `bench moe-layer` print, on inputs with known
answers (issue 37 item 16: the bench tests checked labels only): rate windows, concurrency, fractions of a ceiling."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from moerl.bench.common import Row, format_table
from moerl.config import load_config


def _rows(n: int) -> list[dict]:
    """n training steps: step s took s seconds and trained 10 s samples of mean length 4; reward s / 10."""
    return [{"step": s, "time/step_s": float(s), "samples": 10 * s, "length/mean": 4.0, "reward/mean": s / 10,
             "time/idle_s": s / 2, "time/train_wait_s": s / 4, "time/generate_s": 1.0, "is/behaviour_kl": s / 100,
             "count/stale_dropped": s, "count/groups_done": 3 * s} for s in range(1, n + 1)]


def test_loop_rates_leave_the_first_fifth_out_and_divide_by_the_steps_time():
    from moerl.bench.loop import loop_rates

    warm_start = [{"step": -1, "time/step_s": 99.0, "samples": 999}]  # warm-start rows and evals count nothing
    evals = [{"step": 8, "eval/reward": 1.0}]  # logged after the last step, at the step it evaluated
    r = loop_rates(warm_start + _rows(10) + evals)
    # steps 3..10 (the first 20% of 10 = 2 steps out): 10 x (3+...+10) = 520 samples over 3+...+10 = 52 s
    assert r["wall_s"] == 52.0 and r["samples_per_s"] == pytest.approx(10.0)
    assert r["tokens_per_s"] == pytest.approx(40.0)  # x mean length 4
    assert r["phases"]["idle"] == pytest.approx(0.5) and r["phases"]["train_wait"] == pytest.approx(0.25)
    assert r["inner"]["generate"] == pytest.approx(1.0)  # per step, over the 8 steps
    assert r["reward"] == pytest.approx(1.0)  # the last 20% of the 8 steps counted: step 10 alone
    assert r["kl_max"] == pytest.approx(0.10) and r["kl_median"] == pytest.approx(0.07)  # sorted 0.03..0.10, index 4
    assert (r["stale_dropped"], r["groups"]) == (10, 30)  # the last training row's counters, not the eval's
    assert loop_rates(_rows(3))["wall_s"] == 5.0  # a short run still leaves its first step out: 2 + 3 s


def test_loop_concurrency_is_the_gate_or_what_the_workers_take():
    from moerl.bench.loop import _concurrency

    def cfg(mode: str, workers: int, inflight: int):
        return load_config(None, [f"--train.mode={mode}", "--train.batch_groups=8", "--train.max_staleness=2",
                                  f"--rollout.num_workers={workers}", f"--rollout.max_inflight_groups={inflight}"])
    assert _concurrency(cfg("sync", 4, 100)) == 8  # one batch per version
    assert _concurrency(cfg("async", 4, 100)) == 24  # (staleness 2 + 1) batches
    assert _concurrency(cfg("async", 2, 5)) == 10  # the workers take 2 x 5
    assert _concurrency(cfg("sync", 1, 3)) == 3


@dataclass
class _Out:
    completion: object | None


@dataclass
class _Completion:
    token_ids: list[int]


def test_the_engine_alone_is_fed_continuously_for_its_window():
    """Every step takes 0.5 s on the clock and finishes 3 completions of 7 tokens; each is replaced at once."""
    from moerl.bench.loop import fed_continuously

    now = [0.0]
    submitted = []

    def step():
        now[0] += 0.5
        return [_Out(_Completion([0] * 7)) for _ in range(3)] + [_Out(None)]
    samples, tokens, seconds = fed_continuously(step, lambda: submitted.append(1), 2.0, clock=lambda: now[0])
    assert (samples, tokens, seconds) == (12, 84, 2.0) and len(submitted) == 12  # 4 steps fill the 2 s window


def test_async_rates_start_when_the_first_step_trained_and_count_duplicates():
    from moerl.bench.async_loop import _median, run_rates

    rows = [{"step": -2, "time": 1.0}, {"step": 1, "time": 10.0, "time/train_s": 2.0, "samples": 16, "reward/mean": 0.0}]
    rows += [{"step": s, "time": 10.0 + 2 * (s - 1), "samples": 16, "reward/mean": s / 10} for s in range(2, 11)]
    traj = [{"task_id": "a", "sample_index": i} for i in range(4)] + [{"task_id": "a", "sample_index": 1}]
    r = run_rates(rows, traj)
    # 160 samples from t0 = 10 - 2 = 8 s to the last step at 28 s
    assert r["samples_per_s"] == pytest.approx(8.0)
    assert r["reward"] == pytest.approx((0.9 + 1.0) / 2)  # the last 20% of 10 steps
    assert r["duplicates"] == 1
    assert _median([{"samples_per_s": v} for v in (5.0, 1.0, 3.0)])["samples_per_s"] == 3.0


def test_checkpoint_rates_and_the_disks_ceiling():
    from moerl.bench.checkpoint import checkpoint_rows, layers_for

    assert layers_for(200, base=1_000_000, per_layer=1_000_000) == 16  # 200 MB / 12 B = 16.7M params: 1M + 16 x 1M
    assert layers_for(1, base=10_000_000, per_layer=1_000_000) == 1  # never below one layer
    seconds = {"save": 2.0, "put": 4.0, "load": 1.0, "cat": 0.5, "stall": 0.25, "async_steps": 3.0, "sync_steps": 6.0}
    rows = checkpoint_rows(400_000_000, 800e6, seconds)
    assert [(r.ours, r.peer, r.ceiling) for r in rows] == [(200.0, 100.0, 800.0), (400.0, 800.0, None),
                                                          (0.25, 2.0, None), (3.0, 6.0, None)]
    table = format_table("t", rows).splitlines()
    assert "2.00x" in table[3] and "25.0%" in table[3]  # save: twice the peer's rate, a quarter of the disk's
    assert "0.50x" in table[4]  # load: half the peer's
    assert "8.00x" in table[5] and "2.00x" in table[6]  # lower is better: blocked 0.25 s against 2 s


def test_moe_layer_flops_and_their_fraction_of_the_peak():
    from moerl.bench.moe_layer import expert_gemm_flops

    assert expert_gemm_flops(1, 1, 1, 1) == 18  # 2 x (2 + 1) multiply-adds forward, x 3 with the backward
    assert expert_gemm_flops(16384, 8, 2048, 768) == 18 * 16384 * 8 * 2048 * 768
    flops = expert_gemm_flops(100_000, 2, 100, 50)  # 1.8e10 FLOPs in 0.1 s: 180 GFLOP/s, 36% of a 500 GFLOP/s peak
    row = Row("layer TFLOP/s", flops / 0.1 / 1e12, None, "TFLOP/s", ceiling=0.5)
    assert row.ours == pytest.approx(0.18)
    assert format_table("t", [row]).splitlines()[3].rstrip().endswith("36.0%")
