"""The fleet simulator (moerl/bench/fleet_sim.py): the real controller over simulated engines on a simulated clock.
Small shapes; the 256- and 1,024-engine runs are `moerl bench fleet` commands recorded in BENCHMARKS.md."""

from __future__ import annotations

import pytest

from moerl.bench.fleet_clock import Histogram
from moerl.bench.fleet_engines import SimEngine
from moerl.bench.fleet_model import EngineModel
from moerl.bench.fleet_sim import FleetSimConfig, simulate
from moerl.cli import main

TINY = dict(engines=16, batch_groups=16, group_size=4, max_new_tokens=16, prompt_len=8, publish_s=0.05,
            transfer_s=0.05, trajectories=False, moe_layers=2, experts=4)


def test_a_long_run_trains_every_group_in_bounded_memory_and_controller_cpu():
    """~10^5 groups leased and collected by the real loop: every step trained a full batch, no sample over the
    staleness bound, resident memory flat after the first tenth, the controller under a quarter of a core."""
    cfg = FleetSimConfig(groups=30_000, max_staleness=2, **{**TINY, "engines": 64, "batch_groups": 64, "group_size": 2})
    r = simulate(cfg)
    assert r.counters["samples_trained"] == r.steps * cfg.batch_groups * cfg.group_size
    assert r.counters["groups_done"] >= cfg.groups
    assert max(r.staleness) <= cfg.max_staleness
    assert r.rss_growth_mb() < 20, r.rss_mb
    assert 0 < r.core_fraction < 0.25


def test_preempted_groups_come_back_and_continue_where_they_stopped():
    """Spot notices at a high rate: work is handed back with its partial completions and finished elsewhere; every
    trained sample has exactly its drawn length (a continuation neither restarts nor duplicates tokens)."""
    cfg = FleetSimConfig(groups=640, preempt_per_hour=600.0, lengths="fixed", **{**TINY, "max_new_tokens": 64},
                         engine=EngineModel(respawn_s=1.0))
    r = simulate(cfg)
    assert r.fleet_counts["preempted"] > 10 and r.counters["preempted"] > 0
    assert r.counters["samples_trained"] == r.steps * cfg.batch_groups * cfg.group_size
    assert r.tokens_per_s == pytest.approx(r.samples_per_s * (cfg.prompt_len + 64))


def test_tokens_carry_the_version_that_made_them():
    e = SimEngine("w0", EngineModel(), version=3, now=0.0)
    e.history = [(0.0, 3), (10.0, 4), (12.5, 5)]
    assert e.versions(start=8.0, n=6) == [3, 3, 4, 4, 4, 5]
    assert e.versions(start=13.0, n=2) == [5, 5]


def test_histogram_quantiles_are_within_a_bin():
    h = Histogram()
    for ms in range(1, 1001):
        h.add(ms / 1000)
    assert h.quantile(0.5) == pytest.approx(0.5, rel=0.1) and h.quantile(0.99) == pytest.approx(0.99, rel=0.1)
    assert h.max == 1.0 and h.mean() == pytest.approx(0.5005)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="lengths 'short'"):
        simulate(FleetSimConfig(lengths="short"))
    with pytest.raises(ValueError, match="groups .5. must be at least one batch"):
        simulate(FleetSimConfig(groups=5))


def test_the_command_prints_the_table(capsys):
    argv = ["bench", "fleet", "--engines", "8,16", "--groups", "64", "--batch-groups", "8", "--group-size", "2",
            "--max-new-tokens", "16", "--publish-s", "0.05", "--transfer-s", "0.05", "--step-fixed-s", "0.1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "\n8 engines" in out and "\n16 engines" in out and "| controller share of one core |" in out
    assert main(["bench", "fleet", "--engines", "many"]) == 2
    assert "--engines takes a comma list of counts, got 'many'" in capsys.readouterr().err
