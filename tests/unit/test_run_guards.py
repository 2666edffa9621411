"""Runs that cannot go on stop, with the cause named (issue 26 items 5-7), on the controller with in-process
fakes (tests/unit/test_controller.py): an input that kills its worker is failed after rollout.max_attempts
deaths instead of being re-run forever; failure shares past train.max_failed_fraction and a run that trained
nothing end the run (RunFailed, exit 1); a step that does not advance is reported, then stops the run."""

from __future__ import annotations

import itertools

import pytest

from moerl.loop.failures import FailureWatch, RunFailed
from moerl.loop.types import GroupResult
from moerl.loop.watchdog import StepWatchdog
from tests.unit.test_controller import FakePool, controller, ok


class KillerPool(FakePool):
    """Workers that finish every group at once, except that a group of prompt `killer` kills its worker: every
    call in flight on it fails, as a dead Ray actor's do. Lost workers are replaced by new ones."""

    def __init__(self, ids, weights, killer: int) -> None:
        super().__init__(ids, weights, auto=True)
        self.killer, self.dead = killer, set()
        self._new_ids = itertools.count(len(ids))

    def dispatch(self, worker_id, task):
        ref = super().dispatch(worker_id, task)
        if task.prompt_index == self.killer:
            self.dead.add(worker_id)
        return ref

    def wait(self, inflight, timeout, also=()):
        return [(ref, None, ConnectionError("actor died")) if inflight[ref][0] in self.dead else (ref, result, error)
                for ref, result, error in super().wait(inflight, timeout, also)]

    def replace_missing(self, version):
        while len(self.inflight_count) < self.target:
            self.inflight_count[f"w{next(self._new_ids)}"] = 0
        return []


def swap_pool(ctl, pool) -> None:
    pool.weights = ctl.weights
    ctl.workers = pool


@pytest.mark.timeout(60)
def test_an_input_that_kills_its_worker_is_failed_after_max_attempts_deaths():
    """It used to be re-leased forever (a reward calling sys.exit killed 84 workers in 4 minutes, 0 steps)."""
    ctl, queue, _ = controller(workers=("w0", "w1"), steps=4, batch_groups=2, max_inflight_per_worker=3,
                               max_staleness=2)
    pool = KillerPool(["w0", "w1"], ctl.weights, killer=1)
    swap_pool(ctl, pool)
    state = ctl.run()
    assert state.step == 4
    [failed] = queue.failed  # max_attempts=2: two deaths with it held alone, then failed for good
    assert failed.prompt_index == 1 and failed.attempts == 2
    assert all(e.startswith("its rollout worker w") and "died (ConnectionError)" in e for e in failed.errors)
    assert state.counters["groups_failed"] == 1 and queue.stats()["died"] == 2
    assert state.counters["workers_lost"] == 3  # once with others held (nobody blamed), twice alone
    assert queue.suspects() == []
    trained = [s for step in ctl.trainer.steps for s in step]
    assert len(trained) == 4 * 2 * 2  # every step full: the innocent groups held with it were trained


class FailingPool(FakePool):
    """Auto workers whose groups fail (an error result) for prompts in `bad`, and whose rewards are `reward`
    (None: the sample's reward failed with `reward_error`)."""

    def __init__(self, ids, weights, bad=lambda index: False, reward=1.0, reward_error=None) -> None:
        super().__init__(ids, weights, auto=True)
        self.bad, self.reward, self.reward_error = bad, reward, reward_error

    def dispatch(self, worker_id, task):
        ref = super().dispatch(worker_id, task)
        _, result, _ = self.results[-1]
        if self.bad(task.prompt_index):
            result = GroupResult(task.task_id, task.prompt_index, worker_id, "error",
                                 error=f"ValueError: prompt {task.prompt_index} leaves no room to generate")
        else:
            result.rewards = [self.reward, 0.0] if self.reward is not None else [None, None]
            result.reward_errors = [self.reward_error] * 2 if self.reward is None else [None, None]
        self.results[-1] = (ref, result, None)
        return ref


@pytest.mark.timeout(60)
def test_groups_that_fail_past_the_bound_stop_the_run_naming_the_first():
    """Prompts over max_seq_len after row 0 failed 4,820 groups, and the run trained prompt 0 over and over."""
    ctl, queue, _ = controller(workers=("w0",), steps=50, batch_groups=2, max_inflight_per_worker=4,
                               max_failed_fraction=0.5, failure_window=20)
    swap_pool(ctl, FailingPool(["w0"], ctl.weights, bad=lambda index: index > 0))
    with pytest.raises(RunFailed) as info:
        ctl.run()
    message = str(info.value)
    assert message.startswith("20 of the last 20 prompt groups failed for good (over train.max_failed_fraction = 0.5)")
    assert "the first: prompt 1 (arith-000001): ValueError: prompt 1 leaves no room to generate" in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error, kind", [("ValueError: reward is not finite: nan", "was not a finite real number"),
                                         ("SystemExit: 1", "raised")])
def test_rewards_that_fail_past_the_bound_stop_the_run(error, kind):
    ctl, queue, _ = controller(workers=("w0",), steps=50, batch_groups=2, max_inflight_per_worker=4,
                               max_failed_fraction=0.5, failure_window=10)
    swap_pool(ctl, FailingPool(["w0"], ctl.weights, reward=None, reward_error=error))
    with pytest.raises(RunFailed) as info:
        ctl.run()
    message = str(info.value)
    assert message.startswith("10 of the last 10 samples could not be trained (over train.max_failed_fraction = 0.5)")
    assert f"their reward {kind} (10)" in message and f"the first: prompt 0 (arith-000000): {error}" in message
    assert ctl.state.step < 50


@pytest.mark.timeout(60)
def test_a_run_that_trained_no_sample_never_ends_as_done():
    """A reward that always returned NaN trained 0 samples and the run printed "done" (exit 0)."""
    ctl, queue, _ = controller(workers=("w0",), steps=2, batch_groups=2, max_inflight_per_worker=2,
                               failure_window=1000)  # the window never fills in so short a run
    swap_pool(ctl, FailingPool(["w0"], ctl.weights, reward=None, reward_error="TypeError: reward returned NoneType"))
    with pytest.raises(RunFailed, match=r"^2 steps trained no sample: 0 prompt groups failed for good and \d+ came "
                                        r"back, \d+ of their \d+ samples could not be trained; the first failure: "
                                        r"prompt 0 \(arith-000000\): TypeError: reward returned NoneType"):
        ctl.run()
    assert ctl.state.step == 2


def test_failures_under_the_bound_or_in_a_window_not_yet_full_go_on():
    watch = FailureWatch(max_fraction=0.5, window=4)
    for i in range(3):
        watch.group_failed(f"t{i}", i, "boom")
    watch.check()  # 3 of 3: the window is not full yet
    good = GroupResult("t9", 9, "w", "ok", rewards=[1.0, None], reward_errors=[None, "KeyError: 'x'"])
    watch.group_back(good)
    with pytest.raises(RunFailed, match="3 of the last 4 prompt groups"):
        watch.check()
    for _ in range(2):
        watch.group_back(good)  # groups: 1 of the last 4 failed; samples: 2 of the last 4, not over a half
    watch.check()
    with pytest.raises(ValueError):
        FailureWatch(max_fraction=0, window=4)


@pytest.mark.timeout(60)
def test_a_stuck_trainer_is_reported_then_stops_the_run():
    """A trainer rank stuck in its step used to stall the run without a line."""
    ctl, queue, pool = controller(workers=("w0",), auto=True, steps=5, batch_groups=1, step_timeout_s=2.0)
    warnings: list[str] = []
    ctl.watchdog.warn = warnings.append
    ctl.trainer.hold = True  # the first step never finishes
    with pytest.raises(RunFailed, match=r"^step 1 did not finish within train.step_timeout_s = 2 s; it waits for the "
                                        r"trainer, whose step has run for \d+ s$"):
        ctl.run()
    assert 1 <= len(warnings) <= 3 and all(w.startswith("no step for ") and "step 1 waits for the trainer" in w
                                           for w in warnings)


def test_the_watchdog_warns_at_each_quarter_and_starts_again_on_a_step():
    now = [0.0]
    said: list[str] = []
    dog = StepWatchdog(100.0, said.append, clock=lambda: now[0])
    for t in (10, 25, 30, 49, 50, 80):
        now[0] = t
        dog.check(3, lambda: "rollout: 0 of 8 groups ready")
    assert [s.split(" (")[0] for s in said] == ["no step for 25 s", "no step for 50 s", "no step for 80 s"]
    assert said[0].endswith("step 3 waits for rollout: 0 of 8 groups ready")
    dog.advanced()  # at 80
    now[0] = 100
    dog.check(4, lambda: "x")
    assert len(said) == 3
    now[0] = 180
    with pytest.raises(RunFailed, match=r"step 4 did not finish within train.step_timeout_s = 100 s; it waits for x"):
        dog.check(4, lambda: "x")
    off = StepWatchdog(0.0, said.append, clock=lambda: now[0])
    now[0] = 10**9
    off.check(1, lambda: "x")


def test_the_watchdogs_clock_starts_again_when_a_step_finishes():
    """The controller never restarted it: a run longer than train.step_timeout_s ended at that time, whatever step
    it was at (issue 37 item 2)."""
    now = [0.0]
    dog = StepWatchdog(100.0, lambda text: None, clock=lambda: now[0])
    for step, t in ((1, 0), (1, 90), (2, 150), (3, 240), (3, 330)):
        now[0] = t
        dog.check(step, lambda: "x")  # every step within 100 s of the previous one
    now[0] = 340
    with pytest.raises(RunFailed, match="step 3 did not finish within"):
        dog.check(3, lambda: "x")
    for t in (400, 10_000):  # a wait the caller says is not a step's (workers starting): not counted
        now[0] = t
        dog.check(4, lambda: "x", counting=False)
    now[0] = 10_099
    dog.check(4, lambda: "x")


class _SlowStart:
    """A fake clock that moves 1 s per reading, and a pool whose workers come up only at `up_at` on it."""

    def __init__(self, pool, up_at: float) -> None:
        self.t, self.pool, self.up_at, self.alive = 0.0, pool, up_at, pool.alive
        pool.alive = lambda: self.alive() if self.t >= up_at else 0
        pool.ready_ids_up = pool.ready_ids
        pool.ready_ids = lambda: pool.ready_ids_up() if self.t >= up_at else []

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_rollout_workers_starting_are_not_a_steps_wait():
    """With train.step_timeout_s below the workers' start time the run died before step 1 ("0 of 2 rollout
    workers up"): their start is bounded by rollout.start_timeout_s, not by the step watchdog."""
    from moerl.loop.controller import Controller

    ctl, queue, pool = controller(workers=("w0",), auto=True, steps=3, batch_groups=1, step_timeout_s=50.0)
    clock = _SlowStart(pool, up_at=500.0)  # ten times the step timeout
    ctl = Controller(ctl.cfg, ctl.task, queue, pool, ctl.trainer, ctl.weights, ctl.builder, ctl.on_step, now=clock)
    assert ctl.run().step == 3 and clock.t >= 500


def test_a_stuck_trainer_is_named_with_the_time_its_step_has_run():
    """A stopped trainer was reported as "whose step has run for 0 s" (the watchdog counted from the run's start,
    the step's time from its own): now both count on one clock, from the step's start."""
    from moerl.loop.controller import Controller

    ctl, queue, pool = controller(workers=("w0",), auto=True, steps=5, batch_groups=1, step_timeout_s=40.0)
    clock = _SlowStart(pool, up_at=0.0)
    ctl = Controller(ctl.cfg, ctl.task, queue, pool, ctl.trainer, ctl.weights, ctl.builder, ctl.on_step, now=clock)
    ctl.trainer.hold = True  # the first step never finishes
    with pytest.raises(RunFailed) as e:
        ctl.run()
    ran = int(str(e.value).split("whose step has run for ")[1].split(" s")[0])
    assert str(e.value).startswith("step 1 did not finish within train.step_timeout_s = 40 s; it waits for the "
                                   "trainer, whose step has run for ") and 30 <= ran <= 50, str(e.value)
