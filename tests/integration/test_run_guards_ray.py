"""Inputs that kill their rollout worker, on Ray (issue 26 item 5): a reward that calls os._exit for one prompt
has that prompt failed after rollout.max_attempts deaths while the run goes on; one that kills every worker ends
the run with one line once rollout.max_worker_losses workers in a row died before finishing a group. (A reward
raising SystemExit used to kill 84 workers in 4 minutes, 0 steps, no error.)

    PYTHONPATH=. RAY_AUTH_MODE=disabled python -m pytest tests/integration/test_run_guards_ray.py -m integration
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from moerl.runlog.run_log import read_jsonl
from moerl.tasks.arithmetic import ArithmeticTask
from tests.integration.test_rl_faults import GROUP, small_config

pytestmark = pytest.mark.integration
KILLER, EXITER = 2, 4  # prompt indexes


class KillerTask(ArithmeticTask):
    """Arithmetic whose reward ends its process for prompt KILLER (as a crashing native reward would) and calls
    sys.exit for prompt EXITER (which fails those samples only)."""

    def reward(self, prompt, completion_token_ids):
        if prompt.index == KILLER:
            os._exit(3)
        if prompt.index == EXITER:
            sys.exit("a reward that exits")
        return super().reward(prompt, completion_token_ids)


class KillEverythingTask(ArithmeticTask):
    def reward(self, prompt, completion_token_ids):
        os._exit(3)


@pytest.mark.timeout(150)
def test_a_reward_that_kills_its_worker_fails_its_prompt_and_the_run_goes_on(tmp_path, shared_ray):
    from moerl.run import train

    cfg = small_config(tmp_path, "--task.name=tests.integration.test_run_guards_ray:KillerTask",
                       "--rollout.max_attempts=2", "--rollout.respawn_backoff_s=0.2", steps=6)
    result = train(cfg)
    print(f"killer: {result['counters']} queue {result['queue']} failed {result['failed_tasks']}")
    assert result["step"] == 6
    assert result["failed_tasks"] == [f"arith-{KILLER:06d}"] and result["queue"]["died"] == 2
    assert result["counters"]["groups_failed"] == 1 and result["counters"]["workers_lost"] >= 2
    rows = read_jsonl(tmp_path / "trajectories.jsonl")
    trained = {r["prompt_index"] for r in rows}
    assert KILLER not in trained and EXITER not in trained  # every sample of the exiting reward failed: none trained
    assert len(rows) == result["counters"]["samples_trained"] > 0
    assert result["counters"]["samples_failed"] >= GROUP  # the group of prompt EXITER, its rewards all failed


@pytest.mark.timeout(150)
def test_workers_that_all_die_end_the_run_with_one_line(tmp_path, shared_ray):
    from moerl.actors.respawn import WorkersKeepDying
    from moerl.run import train

    cfg = small_config(tmp_path, "--task.name=tests.integration.test_run_guards_ray:KillEverythingTask",
                       "--rollout.num_workers=1", "--rollout.max_worker_losses=3", "--rollout.respawn_backoff_s=0.2",
                       "--train.sft_steps=0", steps=2)
    t0 = time.monotonic()
    with pytest.raises(WorkersKeepDying) as info:
        train(cfg)
    message = str(info.value)
    print(message)
    assert message.startswith("no rollout worker stays up: 3 in a row were lost before finishing a group "
                              "(rollout.max_worker_losses); the last, rollout-2: died") and "\n" not in message
    assert time.monotonic() - t0 < 120
