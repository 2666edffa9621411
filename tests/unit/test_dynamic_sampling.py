"""Dynamic sampling (moerl/loop/dynamic_sampling.py): groups whose rewards are all equal are dropped and more are
leased until the batch is full, counted; bounded per step, with a warning, so an all-solved task never spins."""

from __future__ import annotations

import pytest

from moerl.loop.dynamic_sampling import DynamicSampling, zero_advantage
from moerl.loop.types import GroupResult
from tests.unit.test_controller import FakePool, controller


def group(*rewards) -> GroupResult:
    return GroupResult("t", 0, "w0", "ok", rewards=list(rewards))


def test_zero_advantage_groups():
    assert zero_advantage(group(1.0, 1.0)) and zero_advantage(group(0.0, None, 0.0)) and zero_advantage(group(None))
    assert not zero_advantage(group(0.0, 1.0)) and not zero_advantage(group(0.5, None, 0.25))


class SolvedPool(FakePool):
    """Auto results whose rewards are all 1.0 for prompts `solved(index)` (the rest alternate 0/1)."""

    def __init__(self, ids, weights, solved) -> None:
        super().__init__(ids, weights, auto=True)
        self.solved = solved

    def dispatch(self, worker_id, task):
        ref = super().dispatch(worker_id, task)
        if self.solved(task.prompt_index):
            result = self.results[-1][1]
            result.rewards = [1.0] * len(result.rewards)
        return ref


def run(mode: str, solved, max_extra: int, steps: int = 4, batch_groups: int = 3):
    ctl, _, _ = controller(workers=("w0", "w1"), auto=True, mode=mode, steps=steps, batch_groups=batch_groups,
                               max_inflight_per_worker=2)
    ctl.workers = SolvedPool(["w0", "w1"], ctl.weights, solved)
    warnings: list[str] = []
    ctl.dynamic = DynamicSampling(max_extra, warnings.append)
    return ctl, ctl.run(), warnings


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_all_equal_groups_are_dropped_and_replaced(mode):
    ctl, state, warnings = run(mode, solved=lambda i: i % 3 == 0, max_extra=100)
    trained = [s for step in ctl.trainer.steps for s in step]
    assert len(ctl.trainer.steps) == 4 and all(len(step) == 3 * 2 for step in ctl.trainer.steps)  # full batches
    assert all(s.advantage != 0 for s in trained) and state.counters["samples_trained"] == 24
    filtered = state.counters["groups_filtered"]
    assert filtered >= 4 and state.counters["groups_filter_over_limit"] == 0 and not warnings
    assert state.counters["groups_done"] == filtered + 12 + len(state.ready)  # trained, dropped, or waiting
    assert ctl.metrics_logged[-1]["count/groups_filtered"] == filtered


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_solved_task_hits_the_limit_keeps_its_groups_and_warns(mode):
    ctl, state, warnings = run(mode, solved=lambda i: True, max_extra=2, steps=5)
    assert state.step == 5 and len(ctl.trainer.steps) == 5  # did not spin: trained on the all-equal groups
    assert state.counters["groups_filtered"] <= 2 * (state.version + 1)  # at most max_extra per version
    assert state.counters["groups_filter_over_limit"] >= 5 * 3 - state.counters["groups_filtered"]
    assert len(warnings) == 1 and "train.dynamic_sampling_max_extra" in warnings[0]


def test_a_checkpoint_of_before_dynamic_sampling_loads():
    ctl, _, _ = controller()
    saved = ctl.state_dict()
    for key in ("groups_filtered", "groups_filter_over_limit"):
        del saved["counters"][key]
    ctl.load_state_dict(saved)
    assert ctl.state.counters["groups_filtered"] == 0
