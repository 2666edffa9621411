"""A fleet that waits for capacity (issue 38 item 1), without Ray: the rollout pool's bookkeeping over a fake Ray
(actors that answer or not) and a fake census (which of them Ray holds for a node). The same on a real
multi-node Ray: tests/integration/test_fleet_growth.py."""

from __future__ import annotations

import types

import pytest

import moerl.actors.pools as pools_mod
from moerl.actors.capacity import waiting_for_capacity
from moerl.actors.pools import RayRolloutPool
from moerl.loop.work_queue import WorkQueue


class Ref:
    def __init__(self, value=None) -> None:
        self.done, self.value = value is not None, value


class Handle:
    """An actor that answers its pings once `answers` is set."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id, self.answers = worker_id, False
        self._actor_id = types.SimpleNamespace(hex=lambda: f"actor-{worker_id}")
        self.ping = types.SimpleNamespace(remote=lambda: Ref({"version": 0}) if self.answers else Ref())
        self.preempt = types.SimpleNamespace(remote=lambda reason: None)


class FakeActorClass:
    def __init__(self) -> None:
        self.handles: dict[str, Handle] = {}

    def options(self, **_):
        return types.SimpleNamespace(remote=self._make)

    def _make(self, worker_id, spec):
        self.handles[worker_id] = Handle(worker_id)
        return self.handles[worker_id]


@pytest.fixture
def fleet(monkeypatch):
    cls = FakeActorClass()
    fake_ray = types.SimpleNamespace(
        remote=lambda c: cls, nodes=lambda: [], kill=lambda *a, **k: None,
        wait=lambda refs, timeout=0, num_returns=1: ([r for r in refs if r.done], [r for r in refs if not r.done]),
        get=lambda ref: ref.value, available_resources=lambda: {"CPU": 0.0}, exceptions=pools_mod.ray.exceptions)
    monkeypatch.setattr(pools_mod, "ray", fake_ray)
    monkeypatch.setattr(pools_mod, "time", types.SimpleNamespace(monotonic=lambda: 0.0))  # the pool starts at 0
    held = {"actor-rollout-2", "actor-rollout-3"}  # Ray's account: these wait for a node
    events: list[str] = []
    pool = RayRolloutPool(spec=None, target=4, cpus_per_worker=1.0, gpus_per_worker=0.0, queue=WorkQueue(600.0, 3),
                          heartbeat_s=1.0, heartbeat_timeout_s=60.0, start_timeout_s=10.0, min_workers=2,
                          on_event=lambda kind, text: events.append(text),
                          census=lambda ids: {i for i in ids if i in held})
    return pool, cls.handles, held, events


def test_workers_waiting_for_capacity_have_no_deadline_and_join_when_placed(fleet):
    pool, handles, held, events = fleet
    assert pool.unresponsive(1.0) == [] and pool.waiting() == 2
    assert events[-1] == "rollout workers: 0 of 4 up, 2 waiting for capacity, 2 starting (each asks for 1 CPU, 0 GPU)"
    handles["rollout-0"].answers = True
    pool.workers["rollout-0"].ping_ref = Ref({"version": 0})
    pool.unresponsive(2.0)
    assert pool.alive() == 1 and pool.ready_ids() == [], "leases before rollout.min_workers = 2 are up"
    pool.workers["rollout-1"].ping_ref = Ref({"version": 0})
    handles["rollout-1"].answers = True
    pool.unresponsive(3.0)
    assert pool.ready_ids() == ["rollout-0", "rollout-1"]
    assert "rollout worker rollout-1 up (2 of 4 up, 2 waiting for capacity)" in events
    assert any(e.startswith("2 rollout workers up (rollout.min_workers=2): leases start") for e in events)

    # Long past rollout.start_timeout_s: the two waiting for a node are not failed starts.
    for t in range(4, 200, 5):
        assert pool.unresponsive(float(t)) == []
    assert pool.waiting() == 2 and pool._start_failures == 0

    held.discard("actor-rollout-2")  # a node came: rollout-2 is placed, its constructor hangs
    pool.unresponsive(200.0)
    assert pool.waiting() == 1 and events[-1] == ("rollout workers: 2 of 4 up, 1 waiting for capacity, 1 starting "
                                                 "(each asks for 1 CPU, 0 GPU)")
    assert pool.unresponsive(205.0) == []  # its start deadline counts from placement (~199 s), not from the ask
    assert pool.unresponsive(211.0) == ["rollout-2"] and pool._start_failures == 1
    assert "rollout.start_timeout_s" in pool.workers["rollout-2"].lost_reason
    assert pool.remove("rollout-2")  # as the controller does with a lost worker

    held.discard("actor-rollout-3")  # rollout-3 is placed and comes up
    pool.unresponsive(212.0)
    pool.workers["rollout-3"].ping_ref = Ref({"version": 0})
    pool.unresponsive(213.0)
    assert "rollout worker rollout-3 up (3 of 4 up)" in events
    assert pool.ready_ids() == ["rollout-0", "rollout-1", "rollout-3"]


def test_fewer_than_min_workers_placed_in_time_stop_the_run(fleet):
    pool, handles, held, events = fleet
    held.update({"actor-rollout-0", "actor-rollout-1"})  # only one node's worth of room: 1 of min_workers = 2
    held.discard("actor-rollout-3")
    pool.unresponsive(1.0)
    with pytest.raises(RuntimeError) as e:
        pool.unresponsive(10.5)
    assert str(e.value).startswith("only 1 of 4 rollout workers were placed within 10 s (rollout.start_timeout_s) "
                                   "and rollout.min_workers=2 must be up to train: 3 wait for capacity"), str(e.value)


def test_placed_workers_that_hang_and_are_removed_are_failed_starts_not_a_capacity_stop(fleet):
    """Placed workers whose constructors hang are lost at the deadline and removed before the pool tops up: the
    pool then holds fewer than min_workers, yet none waits for capacity, so the start-failure path speaks (it ends
    the run after max_start_failures in a row), not the capacity stop ("only 1 of 4 were placed")."""
    pool, handles, held, events = fleet
    held.clear()  # every worker placed
    pool.max_start_failures = 10
    handles["rollout-0"].answers = True
    pool.workers["rollout-0"].ping_ref = Ref({"version": 0})
    pool.unresponsive(1.0)
    assert pool.alive() == 1 and pool.ready_ids() == []  # 1 of min_workers = 2 up
    lost = pool.unresponsive(10.5)
    assert sorted(lost) == ["rollout-1", "rollout-2", "rollout-3"] and pool._start_failures == 3
    for worker_id in lost:
        pool.remove(worker_id)
    assert pool.unresponsive(11.0) == []  # held: 1, waiting: 0, past the placement deadline, and no stop


def test_census_reads_rays_account_of_each_actor():
    table = {"DEPENDENCIES_UNREADY": {"a": {"Pid": 0}},
             "PENDING_CREATION": {"b": {"Pid": 0}, "c": {"Pid": 4242}, "other-job": {"Pid": 0}}}
    assert waiting_for_capacity(["a", "b", "c", "d"], table.__getitem__) == {"a", "b"}  # c constructs; d is up
    assert waiting_for_capacity([], table.__getitem__) == set()

    def down(state_name):
        raise ConnectionError("GCS unreachable")

    assert waiting_for_capacity(["a"], down) is None  # no census: the pool keeps its elapsed-time deadlines
