"""The first failures of a run are said with their prompts (issue 27 item 4): groups that failed for good and
samples whose reward failed, each a warning (console and error.log through the run's reporter) up to a few, then
one line saying the rest are counted; the counts are in the metrics of every step."""

from __future__ import annotations

import pytest

from moerl.loop.first_errors import FirstErrors
from tests.unit.test_controller import controller
from tests.unit.test_run_guards import FailingPool, swap_pool


@pytest.mark.timeout(60)
def test_failed_groups_are_said_with_their_prompt_and_counted():
    warnings: list[str] = []
    steps: list[dict] = []
    ctl, queue, _ = controller(workers=("w0",), steps=6, batch_groups=2, max_inflight_per_worker=4)
    ctl.first_errors = FirstErrors(warnings.append)
    on_step = ctl.on_step
    ctl.on_step = lambda step, metrics, rows: (steps.append(metrics), on_step(step, metrics, rows))
    swap_pool(ctl, FailingPool(["w0"], ctl.weights, bad=lambda index: index % 2 == 1))
    state = ctl.run()
    assert state.step == 6 and state.counters["groups_failed"] >= 4
    assert warnings[:3] == [f"prompt {i} (arith-{i:06d}) failed for good, never trained: ValueError: prompt {i} "
                            "leaves no room to generate" for i in (1, 3, 5)]
    assert warnings[3] == ("more prompt groups failed: only the first 3 are shown; count/groups_failed in "
                           "metrics.jsonl counts them all") and len(warnings) == 4
    assert steps[-1]["count/groups_failed"] == state.counters["groups_failed"]


@pytest.mark.timeout(60)
def test_failed_rewards_are_said_with_their_prompt_and_sample():
    warnings: list[str] = []
    ctl, queue, _ = controller(workers=("w0",), steps=2, batch_groups=1, max_inflight_per_worker=1,
                               failure_window=1000)
    ctl.first_errors = FirstErrors(warnings.append, limit=1)
    swap_pool(ctl, FailingPool(["w0"], ctl.weights, reward=None,
                               reward_error="Traceback (most recent call last):\n  File x\nZeroDivisionError: boom"))
    with pytest.raises(Exception):  # nothing trained: the run fails (moerl/loop/failures.py), after saying why
        ctl.run()
    assert warnings[0] == ("the reward of prompt 0 (arith-000000) sample 0 failed, not trained: Traceback (most "
                           "recent call last): | ... | ZeroDivisionError: boom")
    assert warnings[1].startswith("more rewards failed: only the first 1 are shown; count/samples_failed")
