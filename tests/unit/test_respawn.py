"""Replacing lost rollout workers (moerl/actors/respawn.py): backoff while they keep dying before finishing a
group, and the run's end, with the cause, when none stays up (they used to be respawned at once, for ever)."""

from __future__ import annotations

import pytest

from moerl.actors.respawn import RespawnPolicy, WorkersKeepDying


def test_losses_in_a_row_back_off_exponentially_capped_and_end_the_run():
    now = [0.0]
    policy = RespawnPolicy(max_losses=6, backoff_s=1.0, backoff_max_s=5.0, clock=lambda: now[0])
    assert policy.wait_s() == 0
    waits = []
    for i in range(5):
        policy.lost(f"rollout-{i}", "died (ActorDiedError)", worked=False)
        waits.append(policy.wait_s())
        now[0] += policy.wait_s()
        assert policy.wait_s() == 0
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(WorkersKeepDying, match=r"^no rollout worker stays up: 6 in a row were lost before finishing "
                                               r"a group \(rollout.max_worker_losses\); the last, rollout-5: died "
                                               r"\(ActorDiedError\)$"):
        policy.lost("rollout-5", "died (ActorDiedError)", worked=False)


def test_a_finished_group_resets_and_a_worker_that_worked_costs_nothing():
    now = [0.0]
    policy = RespawnPolicy(max_losses=3, backoff_s=1.0, backoff_max_s=60.0, clock=lambda: now[0])
    for _ in range(2):
        policy.lost("w", "died", worked=False)
    policy.worked()
    assert policy.in_row == 0 and policy.wait_s() == 0
    for i in range(10):  # a whole node lost: workers that had finished groups are replaced at once
        policy.lost(f"w{i}", "died", worked=True)
    assert policy.in_row == 0 and policy.wait_s() == 0
    with pytest.raises(ValueError):
        RespawnPolicy(max_losses=0, backoff_s=1.0, backoff_max_s=1.0)
