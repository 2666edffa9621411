"""`moerl bench plan` (moerl/bench/plan.py): the closed forms against the fleet simulator and the H200 figures."""

from __future__ import annotations

import pytest

from moerl.bench.fleet_sim import FleetSimConfig, simulate
from moerl.bench.plan import MODELS, NODES, Workload, decode_line, predict, publish_times
from moerl.bench.plan_report import min_trainer_nodes
from moerl.cli import main

SMALL = dict(engines=32, batch_groups=32, group_size=4, max_new_tokens=256, prompt_len=32, trajectories=False,
             moe_layers=2, experts=4, publish_s=0.2, transfer_s=0.2, groups=1600)
SAMPLES_TOLERANCE = 0.4  # the plan's samples/s within 40% of the simulator's (measured: 0.97x-1.32x)
STALENESS_TOLERANCE = 0.6  # versions


@pytest.mark.parametrize("shape", [dict(max_staleness=1), dict(max_staleness=2, lengths="long-tail"),
                                   dict(max_staleness=4, train_tok_s=4000.0)],
                         ids=["gate-bound", "long-tail", "trainer-bound"])
def test_the_plan_agrees_with_the_simulator(shape):
    cfg = FleetSimConfig(**{**SMALL, **shape})
    sim, plan = simulate(cfg), predict(Workload.from_sim(cfg))
    assert plan.samples_per_s == pytest.approx(sim.samples_per_s, rel=SAMPLES_TOLERANCE)
    assert plan.mean_staleness == pytest.approx(sim.mean_staleness, abs=STALENESS_TOLERANCE)


def test_the_engine_line_goes_through_both_h200_measurements():
    a, b = decode_line(10_680.0, 256, 3_163.0, 64)
    assert 256 / (a + b * 256) == pytest.approx(10_680) and 64 / (a + b * 64) == pytest.approx(3_163)
    assert a == pytest.approx(0.01898, rel=0.01) and b == pytest.approx(19.5e-6, rel=0.02)


def test_publish_times_of_a_30b_version_on_p5en():
    t = publish_times(MODELS["qwen3-30b-a3b"], NODES["p5en.48xlarge"], 32, efficiency=0.8, tcp_gbps=100)
    assert t["nccl-broadcast"] == pytest.approx(61e9 / (400e9 * 0.8))  # 61 GB over 3200 Gbps at 80%
    assert t["object-store"] == pytest.approx(32 * 61e9 / 12.5e9)
    assert t["node-sharded-ipc"] < t["node-broadcast-ipc"] < t["object-store"]
    assert min_trainer_nodes(MODELS["qwen3-30b-a3b"], NODES["p5en.48xlarge"]) == 1


def test_the_command_plans_the_eks_config(capsys):
    assert main(["bench", "plan", "--config", "configs/eks-p5en.toml"]) == 0
    out = capsys.readouterr().out
    assert "256 engines" in out and "recommended split of 48 nodes" in out and "| nccl-broadcast | 0.19 |" in out
    assert main(["bench", "plan", "--node", "p9"]) == 2
    assert "--node 'p9' is not a known node kind" in capsys.readouterr().err
