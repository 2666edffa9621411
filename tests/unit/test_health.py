"""Training-health warnings: each collapse sign said once per episode, with its cause and knob, and its end."""

from __future__ import annotations

from moerl.config import HealthConfig
from moerl.runlog.health import HealthWatch


def watch(**kw) -> tuple[HealthWatch, list[str]]:
    said: list[str] = []
    return HealthWatch(HealthConfig(**kw), said.append), said


def healthy(**over) -> dict:
    row = {"policy/entropy": 0.8, "is/ess": 0.95, "reward/all_equal_frac": 0.2, "reward/mean": 0.4}
    row.update(over)
    return row


def test_a_healthy_run_says_nothing():
    w, said = watch()
    for step in range(1, 200):
        w.observe(step, healthy(**{"reward/mean": 0.3 + 0.001 * (step % 7)}))
    assert said == []


def test_entropy_collapse_is_said_once_after_the_window_and_its_end_once():
    w, said = watch(entropy_floor=0.05, window=3)
    entropies = [0.8, 0.02, 0.01, 0.04, 0.01, 0.001, 0.3, 0.3, 0.3, 0.01, 0.01, 0.01]
    for step, e in enumerate(entropies, 1):
        w.observe(step, healthy(**{"policy/entropy": e}))
    assert len(said) == 3 and w.episodes == {"entropy": 2}
    assert said[0].startswith("policy entropy 0.04 nats per token is under train.health.entropy_floor=0.05 for 3 "
                              "steps at step 4") and "train.optim.lr" in said[0]
    assert said[1] == "entropy back to normal for 3 steps at step 9 (it held from step 2 to 6)"
    assert said[2].startswith("policy entropy 0.01") and "at step 12" in said[2]


def test_a_single_noisy_step_is_no_episode():
    w, said = watch(window=2)
    for step, ess in enumerate([0.9, 0.1, 0.9, 0.1, 0.9], 1):
        w.observe(step, healthy(**{"is/ess": ess}))
    assert said == []


def test_low_ess_names_its_knobs():
    w, said = watch(ess_floor=0.3, window=2)
    for step in (1, 2):
        w.observe(step, healthy(**{"is/ess": 0.1, "staleness/mean": 4.0, "is/weight_max": 40.0}))
    assert len(said) == 1 and "0.1 is under train.health.ess_floor=0.3" in said[0]
    assert "staleness 4" in said[0] and "ess_lr_scaling" in said[0] and "m2po" in said[0]


def test_groups_without_signal_and_a_flat_reward():
    w, said = watch(all_equal_max=0.9, flat_reward_steps=4, window=2)
    for step in range(1, 6):
        w.observe(step, healthy(**{"reward/all_equal_frac": 1.0, "reward/mean": 0.0}))
    assert len(said) == 2
    assert said[0].startswith("100% of groups have all rewards equal (no gradient) for 2 steps at step 2")
    assert "dynamic_sampling" in said[0]
    assert said[1].startswith("reward/mean has been 0 on every one of the last 4 steps at step 4")


def test_zero_thresholds_turn_the_checks_off():
    w, said = watch(entropy_floor=0, ess_floor=0, all_equal_max=1, flat_reward_steps=0, window=1)
    for step in range(1, 100):
        w.observe(step, {"policy/entropy": 0.0, "is/ess": 0.0, "reward/all_equal_frac": 1.0, "reward/mean": 0.0})
    assert said == []
