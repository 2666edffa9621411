"""The controller against in-process parts that implement the loop's Protocols (no Ray): leases, late and lost
results, hand-backs, the sync and async lease gates, stale groups dropped or regenerated, and whole runs."""

from __future__ import annotations

import itertools
import time

import pytest

from moerl.loop.controller import Controller, LoopConfig
from moerl.loop.phases import PHASES, PhaseClock
from moerl.loop.samples import SampleBuilder
from moerl.loop.types import GroupResult, GroupTask, RolloutPool, TrainerGroup, WeightSync
from moerl.loop.work_queue import WorkQueue
from moerl.rollout import Completion
from moerl.tasks.arithmetic import ArithmeticTask
from moerl.tasks.base import Prompt


class FakePool:
    """Workers whose results the test feeds (`results`), or, with `auto`, that finish every dispatched group
    at the next `wait` with tokens of the newest delivered weights."""

    def __init__(self, ids, weights: FakeWeights | None = None, auto: bool = False) -> None:
        self.inflight_count = dict.fromkeys(ids, 0)
        self.target = len(ids)
        self.results: list = []  # (ref, GroupResult | None, Exception | None) for the next wait()
        self.dispatched: list[tuple[object, str, GroupTask]] = []
        self.removed: list[str] = []
        self.leaving: list[str] = []
        self.weights, self.auto = weights, auto
        self._refs = itertools.count()

    def ready_ids(self):
        return [w for w in self.inflight_count if w not in self.leaving]

    def inflight(self, worker_id):
        return self.inflight_count[worker_id]

    def alive(self):
        return len(self.inflight_count)

    def dispatch(self, worker_id, task):
        self.inflight_count[worker_id] += 1
        ref = f"ref-{next(self._refs)}"
        self.dispatched.append((ref, worker_id, task))
        if self.auto:
            version = self.weights.delivered if self.weights else 0
            self.results.append((ref, ok(task.task_id, worker_id, task.prompt_index, version), None))
        return ref

    def wait(self, inflight, timeout, also=()):
        out, self.results = [r for r in self.results if r[0] in inflight], []
        for ref, _, _ in out:
            worker = inflight[ref][0]
            if worker in self.inflight_count:
                self.inflight_count[worker] -= 1
        return out

    def mark_leaving(self, worker_id):
        self.leaving.append(worker_id)

    def remove(self, worker_id):
        self.removed.append(worker_id)
        return self.inflight_count.pop(worker_id, None) is not None

    def unresponsive(self, now):
        return []

    def replace_missing(self, version):
        return []

    def preempt_all(self):
        self.leaving.extend(self.inflight_count)


class FakeTrainer:
    """Steps finish as soon as the controller looks (or when the test says, with `hold`)."""

    def __init__(self) -> None:
        self.steps: list[list] = []  # the samples of every step started
        self.hold = False

    def start_rl_step(self, samples):
        self.steps.append(samples)
        return len(self.steps) - 1

    def pending(self, handle):
        return [handle] if self.hold else []

    def done(self, handle):
        return not self.hold

    def result(self, handle, step):
        return {"loss": 0.0, "expert_counts": []}


class FakeWeights:
    def __init__(self) -> None:
        self.versions: list[int] = []  # published
        self.delivered = -1
        self.waits: list[bool] = []

    def publish(self, version):
        self.versions.append(version)

    def published(self):
        pass

    def deliver(self, wait):
        self.delivered = self.versions[-1]
        self.waits.append(wait)


@pytest.mark.parametrize("make, protocol", [(lambda: FakePool(["w0"]), RolloutPool), (FakeTrainer, TrainerGroup),
                                             (FakeWeights, WeightSync)])
def test_fakes_implement_the_protocols(make, protocol):
    """The controller is typed against these Protocols; the fakes (and so these tests) must keep up with them."""
    members = {n for n in vars(protocol) if not n.startswith("_")} | set(vars(protocol).get("__annotations__", {}))
    fake = make()
    assert members and not [n for n in sorted(members) if not hasattr(fake, n)]


def ok(task_id: str, worker_id: str, prompt_index: int = 0, version: int = 0, group_size: int = 2) -> GroupResult:
    comps = [Completion(f"{task_id}/{i}", [1], [2], [-0.1], [version], None, "stop") for i in range(group_size)]
    rewards = [float(i % 2) for i in range(group_size)]
    return GroupResult(task_id, prompt_index, worker_id, "ok", comps, rewards, [None] * group_size)


def controller(workers=("w0", "w1"), lease_timeout: float = 30.0, task=None, auto: bool = False, **loop):
    settings = dict(steps=1, batch_groups=1, group_size=2, max_staleness=1, mode="async", stale_policy="drop",
                    max_inflight_per_worker=1)
    settings.update(loop)
    task = task or ArithmeticTask()
    queue = WorkQueue(lease_timeout=lease_timeout, max_attempts=2)
    weights = FakeWeights()
    pool = FakePool(list(workers), weights, auto=auto)
    trainer = FakeTrainer()
    steps: list[int] = []
    logged: list[dict] = []
    ctl = Controller(LoopConfig(**settings), task, queue, pool, trainer, weights, SampleBuilder(task, True, 2, 4),
                     lambda step, metrics, rows: (steps.append(step), logged.append(metrics)))
    ctl.steps_logged, ctl.metrics_logged = steps, logged  # what on_step saw
    return ctl, queue, pool


# ------------------------------------------------------------------------------ results that come back
def test_late_result_after_lease_expired_and_was_released_is_dropped():
    ctl, queue, pool = controller(workers=("w0",))
    ctl._lease_and_dispatch()  # w0 leases the first prompt
    (ref0, (w, tid)), = ctl.inflight.items()
    assert w == "w0" and pool.inflight("w0") == 1
    silent = ctl.now() + 31  # w0 went silent past its lease (lease_timeout 30)
    ctl.now = lambda: silent
    ctl._check_workers()  # the lease expires: the task is pending again, at the front
    assert queue.stats()["expired"] == 1 and queue.pending_ids() == [tid]

    pool.inflight_count["w1"] = 0  # a second worker takes the task over
    ctl._lease_and_dispatch()
    assert queue.lease_of(tid).worker_id == "w1"
    ref1 = next(r for r, (wid, _) in ctl.inflight.items() if wid == "w1")

    pool.results = [(ref0, ok(tid, "w0"), None)]  # w0's late result: dropped, counted
    ctl._collect(timeout=0)
    assert ctl.state.counters["late_results"] == 1 and ctl.state.ready == []
    assert pool.inflight("w0") == 0, "the expired call still holds a slot of w0"
    pool.results = [(ref1, ok(tid, "w1"), None)]  # w1's result is the one that reaches the trainer
    ctl._collect(timeout=0)
    assert [g.worker_id for g in ctl.state.ready] == ["w1"] and ctl.state.counters["groups_done"] == 1
    assert set(queue.completed_ids) == {tid}


def test_results_of_a_lost_worker_are_dropped_and_its_lease_requeued():
    ctl, queue, pool = controller(workers=("w0", "w1"))
    ctl._lease_and_dispatch()
    refs = {wid: ref for ref, (wid, _) in ctl.inflight.items()}
    tids = {wid: tid for _, (wid, tid) in ctl.inflight.items()}
    died = ConnectionError("actor died")  # what the pool reports for a dead worker's call
    pool.results = [(refs["w0"], None, died), (refs["w0"], None, died)]
    ctl._collect(timeout=0)
    assert ctl.state.counters["workers_lost"] == 1 and pool.removed == ["w0"]
    assert queue.pending_ids() == [tids["w0"]] and queue.stats()["lost"] == 1
    # w0 held that task alone: its death is an attempt of it (an input may have killed it), named in its errors
    assert queue.stats()["died"] == 1 and queue.state_dict()["pending"][0]["errors"] == [
        "its rollout worker w0 died (ConnectionError)"]
    pool.results = [(refs["w1"], ok(tids["w1"], "w1"), None)]
    ctl._collect(timeout=0)
    assert ctl.state.counters["groups_done"] == 1


def test_preempted_result_hands_back_partials_and_the_worker_takes_no_more():
    ctl, queue, pool = controller(workers=("w0",))
    ctl._lease_and_dispatch()
    (ref, (_, tid)), = ctl.inflight.items()
    partial = [Completion(f"{tid}/0", [1], [2, 3], [-0.1, -0.2], [0, 0], None, "abort"), None]
    pool.results = [(ref, GroupResult(tid, 0, "w0", "preempted", partial), None)]
    ctl._collect(timeout=0)
    assert ctl.state.counters["preempted"] == 1 and queue.stats()["handed_back"] == 1
    assert queue.pending_ids() == [tid] and queue._tasks[tid].partials == partial  # not an attempt
    assert queue._tasks[tid].attempts == 0 and pool.leaving == ["w0"]
    ctl._lease_and_dispatch()  # the leaving worker gets nothing more; the task waits for another
    assert ctl.inflight == {} and queue.pending_ids() == [tid]


# ------------------------------------------------------------------------------ lease gates
def test_sync_mode_leases_one_batch_per_version_and_none_while_training():
    ctl, queue, pool = controller(workers=("w0", "w1", "w2"), mode="sync", batch_groups=2, steps=3,
                                  max_inflight_per_worker=4)
    ctl._lease_and_dispatch()
    assert len(pool.dispatched) == 2, "sync mode leases exactly one batch for version 0"
    pool.results = [(ref, ok(t.task_id, w, t.prompt_index), None) for ref, w, t in pool.dispatched]
    ctl._collect(timeout=0)
    ctl.trainer.hold = True
    ctl._try_start_training()
    assert ctl.training is not None and len(ctl.trainer.steps) == 1
    ctl._lease_and_dispatch()
    assert len(pool.dispatched) == 2, "leased while the batch trains"
    ctl.trainer.hold = False
    ctl._finish_training()
    assert ctl.state.version == 1 and ctl.weights.waits[-1] is True  # sync: workers hold v1 before leasing
    ctl._lease_and_dispatch()
    assert len(pool.dispatched) == 4 and ctl.state.leased_total == 4


def test_async_mode_leases_ahead_up_to_the_staleness_bound():
    ctl, queue, pool = controller(workers=("w0",), mode="async", batch_groups=2, max_staleness=1, steps=5,
                                  max_inflight_per_worker=100)
    ctl._lease_and_dispatch()
    assert len(pool.dispatched) == (0 + 1 + 1) * 2  # (version + max_staleness + 1) * batch_groups
    ctl.state.version = 1
    ctl._lease_and_dispatch()
    assert len(pool.dispatched) == (1 + 1 + 1) * 2


# ------------------------------------------------------------------------------ stale groups
def _stale_ready(ctl, task_id: str, prompt_index: int) -> None:
    ctl.state.version = 5
    ctl.state.ready = [ok(task_id, "w0", prompt_index, version=5 - ctl.cfg.max_staleness - 1)]


def test_stale_group_is_dropped_under_the_drop_policy():
    ctl, queue, _ = controller(stale_policy="drop")
    _stale_ready(ctl, "arith-000004", 4)
    assert ctl._take_batch() is None
    assert ctl.state.counters["stale_dropped"] == 1 and len(queue) == 0 and ctl.state.ready == []


def test_stale_group_is_regenerated_from_its_own_prompt():
    ctl, queue, _ = controller(stale_policy="regenerate")
    _stale_ready(ctl, "arith-000004", 4)
    assert ctl._take_batch() is None
    assert ctl.state.counters["stale_regenerated"] == 1 and queue.pending_ids() == ["arith-000004-r"]
    fresh = queue._tasks["arith-000004-r"]
    assert fresh.prompt_index == 4 and fresh.prompt_token_ids == ArithmeticTask().prompt_at(4).prompt_token_ids
    assert fresh.partials == [None, None] and fresh.attempts == 0


def test_dropped_and_failed_groups_give_their_gate_slots_back():
    """Regression: a stale group dropped (or a group that failed for good) kept its slot in the lease gate, so
    after max_staleness x batch_groups of them the gate stayed shut with less than a batch ready: a hang."""
    ctl, queue, pool = controller(workers=("w0",), batch_groups=2, max_staleness=0, steps=2,
                                  max_inflight_per_worker=100)
    ctl._lease_and_dispatch()
    assert len(pool.dispatched) == 2  # (version + max_staleness + 1) x batch_groups
    pool.results = [(ref, ok(t.task_id, w, t.prompt_index, version=-1), None) for ref, w, t in pool.dispatched]
    ctl._collect(timeout=0)
    assert ctl._take_batch() is None and ctl.state.counters["stale_dropped"] == 2
    ctl._lease_and_dispatch()
    assert len(pool.dispatched) == 4, "the dropped groups' slots were not given back"
    for attempt in range(2):  # max_attempts=2: the second error fails the group for good
        ref, w, t = pool.dispatched[-1]
        pool.results = [(ref, GroupResult(t.task_id, t.prompt_index, w, "error", error="boom"), None)]
        ctl._collect(timeout=0)
        ctl._lease_and_dispatch()
    assert ctl.state.counters["groups_failed"] == 1 and len(pool.dispatched) == 6  # a retry, then a new prompt


class NamedTask(ArithmeticTask):
    """A custom task whose ids do not end in digits (they name the problem)."""

    def prompt_at(self, index: int) -> Prompt:
        prompt = super().prompt_at(index)
        prompt.task_id = f"sum-of-{prompt.prompt_text.strip().replace(' ', '')}-q"
        return prompt


def test_a_group_regenerated_twice_keeps_its_prompt():
    """Regression: the regenerated task's prompt came from parsing digits at the end of its id, so a second
    regeneration (`...-r`) and any task whose ids end otherwise trained on prompt 0."""
    task = NamedTask()
    ctl, queue, pool = controller(workers=("w0",), stale_policy="regenerate", task=task, max_staleness=0)
    index = 7
    first = task.prompt_at(index)
    assert task.prompt_at(0).prompt_token_ids != first.prompt_token_ids
    _stale_ready(ctl, first.task_id, index)
    ctl._take_batch()
    ctl._lease_and_dispatch()  # a worker takes the regenerated group ...
    (ref, w, leased), = pool.dispatched
    assert leased.task_id == f"{first.task_id}-r" and leased.prompt_index == index
    pool.results = [(ref, ok(leased.task_id, w, leased.prompt_index, version=ctl.state.version - 1), None)]
    ctl._collect(timeout=0)  # ... and it comes back stale again: regenerated a second time
    ctl._take_batch()
    twice = queue._tasks[f"{first.task_id}-r-r"]
    assert twice.prompt_index == index and twice.prompt_token_ids == first.prompt_token_ids
    assert ctl.state.counters["stale_regenerated"] == 2


# ------------------------------------------------------------------------------ whole runs
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_run_trains_every_finished_group_once_and_publishes_every_version(mode):
    ctl, queue, pool = controller(workers=("w0", "w1"), auto=True, mode=mode, steps=4, batch_groups=3,
                                  max_inflight_per_worker=2)
    state = ctl.run()
    assert state.step == 4 and state.version == 4 and ctl.steps_logged == [1, 2, 3, 4]
    assert ctl.weights.versions == [0, 1, 2, 3, 4]
    assert ctl.weights.waits == [True] + [mode == "sync"] * 4  # the first weights always before any lease
    trained = [s for step in ctl.trainer.steps for s in step]
    assert len(ctl.trainer.steps) == 4 and len(trained) == 4 * 3 * 2
    assert state.counters["groups_done"] == len(queue.completed_ids) >= 12
    assert state.counters["samples_trained"] == 24 and state.counters["stale_dropped"] == 0
    for m in ctl.metrics_logged:  # the phases partition each step's wall time
        phases = sum(v for k, v in m.items() if k.startswith("time/") and k.endswith("_s")
                     and k.removeprefix("time/").removesuffix("_s") in PHASES)
        assert phases == pytest.approx(m["time/step_s"], rel=1e-9, abs=1e-9) and m["time/step_s"] > 0


def test_phase_clock_partitions_wall_time():
    now = [0.0]
    clock = PhaseClock(lambda: now[0])
    now[0] = 1.0
    with clock.during("idle"):
        now[0] = 3.5
        with clock.during("train_wait"):
            now[0] = 4.0
    now[0] = 4.25
    lap = clock.lap()
    assert lap["time/controller_s"] == 1.25 and lap["time/idle_s"] == 2.5 and lap["time/train_wait_s"] == 0.5
    assert lap["time/step_s"] == 4.25 and clock.phase == "controller"
    now[0] = 5.0
    assert clock.lap()["time/step_s"] == 0.75
    with pytest.raises(ValueError, match="unknown phase 'lunch'"):
        clock.switch("lunch")


class FakeCheckpoints:
    def __init__(self) -> None:
        self.saves: list[tuple[int, int, dict]] = []  # (step, trainer steps started, controller state)

    def save(self, step, trainer, controller_state):
        self.saves.append((step, len(trainer.steps), controller_state))

    def poll(self):
        return None

    def wait(self):
        return None


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_graceful_stop_saves_one_consistent_cut(mode):
    """SIGTERM mid-run: the saved trainer has run exactly the saved controller's steps, and every completed
    group is either trained in them or in the saved ready buffer (async mode used to start the next step before
    saving: the trainer one step ahead, that step's groups in neither)."""
    ctl, queue, pool = controller(workers=("w0", "w1"), auto=True, mode=mode, steps=50, batch_groups=2,
                                  max_inflight_per_worker=4, max_staleness=4)
    ctl.checkpoints = FakeCheckpoints()
    ctl.stop_requested = lambda: ctl.state.step >= 3
    state = ctl.run()
    (step, trainer_steps, saved), = ctl.checkpoints.saves
    assert step == state.step == saved["step"] == trainer_steps >= 3
    completed = saved["queue"]["counters"]["completed"]
    assert completed == step * 2 + len(saved["ready"]) + saved["counters"]["stale_dropped"]


def test_a_time_limit_ends_the_run_as_a_graceful_stop():
    """train.time_limit_s: once the RL has run that long the loop ends like a graceful stop (the step in flight
    finishes, one consistent cut is saved), with fewer steps than asked."""
    now = [1000.0]
    ctl, queue, pool = controller(workers=("w0",), auto=True, mode="async", steps=50, batch_groups=2,
                                  max_inflight_per_worker=4, max_staleness=1, time_limit_s=30.0)
    ctl.now = lambda: now[0]  # the loop's injected clock (Controller's `now`)
    ctl.checkpoints = FakeCheckpoints()
    steps_seen = []
    on_step = ctl.on_step

    def tick(step, metrics, rows):  # each step takes 10 "seconds"
        steps_seen.append(step)
        now[0] += 10.0
        on_step(step, metrics, rows)
    ctl.on_step = tick
    state = ctl.run()
    assert 3 <= state.step < 50 and state.step == steps_seen[-1]
    (step, trainer_steps, _), = ctl.checkpoints.saves
    assert step == trainer_steps == state.step


@pytest.mark.parametrize("k", [1, 3])
def test_forced_staleness_trains_every_batch_exactly_k_versions_behind(k):
    """Batch b is generated by version max(0, b - k) and trained at version b, whatever the timing: the workers'
    weights go forward in lock-step, once the batch they generate is back and the step that made them ended."""
    ctl, queue, pool = controller(workers=("w0", "w1"), auto=True, steps=8, batch_groups=2, max_staleness=k,
                                  forced_staleness=k, max_inflight_per_worker=3)
    state = ctl.run()
    assert state.step == 8 and state.counters["stale_dropped"] == 0
    for step, m in enumerate(ctl.metrics_logged):
        assert m["staleness/mean"] == m["staleness/max"] == min(step, k), (step, m["staleness/mean"])
    assert ctl.weights.waits == [True] * (1 + 8)  # every delivery waits for the workers to hold it
    assert len(ctl.trainer.steps) == 8 and all(len(s) == 2 * 2 for s in ctl.trainer.steps)
