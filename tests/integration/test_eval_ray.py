"""Evaluation and dynamic sampling in a real `moerl train` run on the suite's local Ray: evals at steps 0, 2 and 4
on a held worker (logged at their steps, with their weights' version) while training goes on; dynamic sampling
counted. Short: a random-init model, 4 steps."""

from __future__ import annotations

import pytest

from moerl.config import load_config
from moerl.runlog.run_log import read_jsonl
from tests.integration.test_rl_faults import DEMO

pytestmark = pytest.mark.integration


@pytest.mark.timeout(150)
def test_a_run_evaluates_on_held_workers_and_filters_groups(tmp_path, shared_ray):
    from moerl.run import train

    cfg = load_config(DEMO, [f"--run.dir={tmp_path}", "--train.sft_steps=0", "--train.steps=4",
                             "--train.batch_groups=2", "--rollout.group_size=4", "--eval.every=2",
                             "--eval.before_train=true", "--eval.samples=6", "--train.dynamic_sampling=true",
                             "--train.dynamic_sampling_max_extra=2"])
    result = train(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    evals = [r for r in rows if "eval/prompts" in r]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and [r["eval/version"] for r in evals] == [0, 2, 4]
    for r in evals:
        assert r["eval/prompts"] == 6 and r["eval/partial"] == 0 and 0 <= r["eval/pass@1"] <= 1
        assert r["eval/length"] > 0 and "samples" not in r
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and sum(r["samples"] for r in steps) <= 4 * 2 * 4
    counters = result["counters"]
    assert counters["groups_filtered"] + counters["groups_filter_over_limit"] > 0
    assert steps[-1]["count/groups_filtered"] == counters["groups_filtered"]
    assert (tmp_path / "reward.png").exists() and (tmp_path / "tensorboard").is_dir()  # run.plots, run.tensorboard on
