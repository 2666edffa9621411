"""The controller's work queue: leases, stale results, hand-backs, retries, failures, checkpoints."""

from __future__ import annotations

import json
import random

import pytest

from moerl.loop.types import GroupTask
from moerl.loop.work_queue import WorkQueue

TIMEOUT = 10.0


def task(i: int, group_size: int = 2) -> GroupTask:
    return GroupTask(f"t{i}", i, [1, 2, i], group_size)


def queue(n: int = 0, max_attempts: int = 3) -> WorkQueue:
    q = WorkQueue(lease_timeout=TIMEOUT, max_attempts=max_attempts)
    for i in range(n):
        q.add(task(i))
    return q


def lease_ids(q: WorkQueue, worker: str, k: int, now: float = 0.0) -> list[str]:
    return [q.lease(worker, now).task_id for _ in range(k)]  # type: ignore[union-attr]


def roundtrip(q: WorkQueue) -> WorkQueue:
    q2 = WorkQueue(lease_timeout=q.lease_timeout, max_attempts=q.max_attempts)
    q2.load_state_dict(json.loads(json.dumps(q.state_dict())))
    return q2


# ------------------------------------------------------------------ targeted
def test_fifo_lease_and_empty() -> None:
    q = queue(3)
    assert (len(q), q.pending(), q.leased()) == (3, 3, 0)
    assert lease_ids(q, "a", 2) == ["t0", "t1"]
    assert lease_ids(q, "b", 1) == ["t2"]
    assert q.lease("a", 0.0) is None
    assert q.workers() == {"a": ["t0", "t1"], "b": ["t2"]}
    assert (len(q), q.pending(), q.leased()) == (3, 0, 3)
    lease = q.lease_of("t0")
    assert lease is not None and (lease.worker_id, lease.granted_at, lease.deadline) == ("a", 0.0, TIMEOUT)


def test_complete_exactly_once_and_never_readded() -> None:
    q = queue(1)
    q.lease("a", 0.0)
    assert not q.complete("t0", "b", 1.0)  # not the holder
    assert q.complete("t0", "a", 1.0)
    assert not q.complete("t0", "a", 1.0)  # duplicate
    assert not q.complete("nope", "a", 1.0)
    assert len(q) == 0 and q.stats()["completed"] == 1
    with pytest.raises(ValueError, match="already added"):
        q.add(task(0))


def test_expired_then_released_lease_cannot_be_completed_by_old_holder() -> None:
    q = queue(1)
    q.lease("a", 0.0)
    assert q.expire(TIMEOUT) == []  # deadline itself is still live
    assert q.expire(TIMEOUT + 0.1) == ["t0"]
    assert q.lease("b", 11.0).task_id == "t0"  # type: ignore[union-attr]
    assert not q.complete("t0", "a", 11.5)
    assert q.hand_back("t0", "a", ["x", None], 11.5) is False
    assert q.fail("t0", "a", "boom", 11.5) == "stale"
    assert q.lease_of("t0").worker_id == "b"  # type: ignore[union-attr]
    assert q.complete("t0", "b", 12.0)
    assert q.stats()["expired"] == 1 and q.lease_of("t0") is None


def test_lease_past_deadline_is_dead_before_sweep_and_heartbeat_extends() -> None:
    q = queue(2)
    q.lease("a", 0.0)
    q.lease("a", 0.0)
    q.heartbeat("a", 8.0)
    assert q.lease_of("t0").deadline == 18.0  # type: ignore[union-attr]
    assert q.complete("t0", "a", 17.0)
    assert not q.complete("t1", "a", 18.5)  # past deadline, not yet swept: stale
    q.heartbeat("a", 19.0)  # does not revive a dead lease
    assert q.lease_of("t1").deadline == 18.0  # type: ignore[union-attr]
    assert q.expire(19.0) == ["t1"] and q.pending_ids() == ["t1"]


def test_hand_back_goes_to_front_with_partials_and_is_not_an_attempt() -> None:
    q = queue(3)
    q.lease("a", 0.0)
    assert q.hand_back("t0", "a", [{"tokens": [5, 6]}, None], 1.0)
    assert q.pending_ids() == ["t0", "t1", "t2"]
    t = q.lease("b", 2.0)
    assert t is not None and t.task_id == "t0" and t.partials == [{"tokens": [5, 6]}, None] and t.attempts == 0
    with pytest.raises(ValueError, match="partials"):
        q.hand_back("t0", "b", [None], 2.0)
    assert q.stats()["handed_back"] == 1


def test_fail_retries_at_end_then_records_failure_with_all_errors() -> None:
    q2 = queue(1, max_attempts=3)
    results = []
    for k in range(3):
        assert q2.lease("a", float(k)).task_id == "t0"  # type: ignore[union-attr]
        results.append(q2.fail("t0", "a", f"err{k}", float(k)))
    assert results == ["retry", "retry", "failed"]
    assert q2.lease("a", 5.0) is None and len(q2) == 0
    [f] = q2.failed
    assert (f.task_id, f.attempts, f.errors) == ("t0", 3, ["err0", "err1", "err2"])
    assert q2.stats()["retried"] == 2 and q2.stats()["failed"] == 1
    assert not q2.complete("t0", "a", 6.0)
    with pytest.raises(ValueError):
        q2.add(task(0))


def test_fail_retry_goes_to_the_end() -> None:
    q = queue(3)
    q.lease("a", 0.0)
    assert q.fail("t0", "a", "oom", 0.0) == "retry"
    assert q.pending_ids() == ["t1", "t2", "t0"]


def test_worker_lost_and_expire_requeue_front_in_stable_lease_order() -> None:
    q = queue(6)
    assert lease_ids(q, "a", 1) + lease_ids(q, "b", 1) + lease_ids(q, "a", 2) == ["t0", "t1", "t2", "t3"]
    q.heartbeat("b", 5.0)
    assert q.worker_lost("a", 6.0) == ["t0", "t2", "t3"]
    assert q.pending_ids() == ["t0", "t2", "t3", "t4", "t5"]
    assert q.worker_lost("a", 6.0) == []
    assert lease_ids(q, "c", 2, now=7.0) == ["t0", "t2"]
    # b's deadline 15, c's 17: at 16 only b's expires; at 18 c's expire as a block in lease order.
    assert q.expire(16.0) == ["t1"] and q.pending_ids() == ["t1", "t3", "t4", "t5"]
    assert q.expire(18.0) == ["t0", "t2"] and q.pending_ids() == ["t0", "t2", "t1", "t3", "t4", "t5"]
    s = q.stats()
    assert (s["lost"], s["expired"], s["pending"], s["leased"]) == (3, 3, 6, 0)
    assert all(t["attempts"] == 0 for t in q.state_dict()["pending"])


def test_state_dict_roundtrip_keeps_order_and_turns_leases_into_front_pending() -> None:
    q = queue(6, max_attempts=1)
    lease_ids(q, "a", 1)
    assert q.complete("t0", "a", 0.0)
    lease_ids(q, "a", 1)
    assert q.fail("t1", "a", "bad", 0.0) == "failed"
    lease_ids(q, "b", 1)
    lease_ids(q, "a", 1)
    q.hand_back("t3", "a", [None, "half"], 1.0)  # t3 back at the front
    assert lease_ids(q, "c", 1) == ["t3"]
    lease_ids(q, "b", 1)  # leases in grant order: t2 (b), t3 (c), t4 (b); pending: t5
    state = q.state_dict()
    json.dumps(state)  # JSON-able when the partials are
    q2 = roundtrip(q)
    assert q2.pending_ids() == ["t2", "t3", "t4", "t5"] and q2.leased() == 0 and q2.workers() == {}
    assert q2.state_dict()["pending"][1]["partials"] == [None, "half"]
    assert q2.stats() | {"pending": 0, "leased": 0} == q.stats() | {"pending": 0, "leased": 0}
    assert [(f.task_id, f.errors) for f in q2.failed] == [("t1", ["bad"])]
    for i in (0, 1):
        with pytest.raises(ValueError):
            q2.add(task(i))
    # the original is untouched by state_dict and still works
    assert q.complete("t3", "c", 2.0) and q.leased() == 2


def test_state_dict_keeps_opaque_partials_as_given() -> None:
    class Partial:  # not JSON-able: the checkpoint layer deals with it
        pass

    p = Partial()
    q = queue(1)
    q.lease("a", 0.0)
    q.hand_back("t0", "a", [p, None], 0.0)
    q.lease("b", 0.0)
    d = q.state_dict()
    assert d["leased"][0]["partials"][0] is p
    q2 = queue()
    q2.load_state_dict(d)
    t = q2.lease("c", 0.0)
    assert t is not None and t.partials[0] is p


def test_validation() -> None:
    with pytest.raises(ValueError):
        WorkQueue(lease_timeout=0, max_attempts=1)
    with pytest.raises(ValueError):
        WorkQueue(lease_timeout=1, max_attempts=0)
    with pytest.raises(ValueError):
        GroupTask("x", 0, [1], 2, [None])
    assert GroupTask("x", 0, [1], 3).partials == [None, None, None]
    q = queue(1)
    with pytest.raises(ValueError, match="already added"):
        q.add(task(0))
    with pytest.raises(ValueError, match="version"):
        q.load_state_dict({"version": 99})


# ------------------------------------------------------------------ property-style
class Model:
    """A transparent reference: pending order, leases with deadlines, terminal sets."""

    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max_attempts
        self.pending: list[str] = []
        self.leases: dict[str, tuple[str, float]] = {}
        self.attempts: dict[str, int] = {}
        self.errors: dict[str, list[str]] = {}
        self.partials: dict[str, list] = {}
        self.completed: set[str] = set()
        self.failed: list[str] = []

    def held(self, tid: str, w: str, now: float) -> bool:
        return tid in self.leases and self.leases[tid][0] == w and now <= self.leases[tid][1]

    def front(self, ids: list[str]) -> None:
        for t in ids:
            del self.leases[t]
        self.pending[:0] = ids


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_match_reference_model(seed: int) -> None:
    rng = random.Random(seed)
    max_attempts = rng.randint(1, 4)
    q, m = WorkQueue(lease_timeout=TIMEOUT, max_attempts=max_attempts), Model(max_attempts)
    workers = ["w0", "w1", "w2", "w3"]
    added: list[str] = []
    completed_true: list[str] = []
    now = 0.0
    ops = ["add", "lease", "lease", "heartbeat", "complete", "complete", "stale_complete", "hand_back", "fail",
           "lost", "expire", "tick", "checkpoint"]
    for step in range(400):
        op = rng.choice(ops)
        w = rng.choice(workers)
        leased = list(m.leases)
        if op == "add":
            i = len(added)
            q.add(GroupTask(f"g{i}", i, [i], 2))
            added.append(f"g{i}")
            m.pending.append(f"g{i}")
            m.attempts[f"g{i}"], m.errors[f"g{i}"], m.partials[f"g{i}"] = 0, [], [None, None]
        elif op == "lease":
            t = q.lease(w, now)
            if m.pending:
                tid = m.pending.pop(0)
                assert t is not None and t.task_id == tid and t.partials == m.partials[tid]
                m.leases[tid] = (w, now + TIMEOUT)
            else:
                assert t is None
        elif op == "heartbeat":
            q.heartbeat(w, now)
            for tid, (hw, dl) in m.leases.items():
                if hw == w and now <= dl:
                    m.leases[tid] = (w, now + TIMEOUT)
        elif op in ("complete", "stale_complete", "hand_back", "fail"):
            pool = leased + added if op == "stale_complete" else leased
            if not pool:
                continue
            tid = rng.choice(pool)
            if op != "stale_complete" and rng.random() < 0.8:
                w = m.leases[tid][0]  # usually the holder; sometimes a wrong worker
            ok = m.held(tid, w, now)
            if op in ("complete", "stale_complete"):
                assert q.complete(tid, w, now) is ok
                if ok:
                    del m.leases[tid]
                    m.completed.add(tid)
                    completed_true.append(tid)
            elif op == "hand_back":
                parts = [f"{tid}@{step}", None]
                assert q.hand_back(tid, w, parts, now) is ok
                if ok:
                    m.partials[tid] = parts
                    m.front([tid])
            else:
                res = q.fail(tid, w, f"e{step}", now)
                if not ok:
                    assert res == "stale"
                else:
                    del m.leases[tid]
                    m.attempts[tid] += 1
                    m.errors[tid].append(f"e{step}")
                    if m.attempts[tid] < max_attempts:
                        assert res == "retry"
                        m.pending.append(tid)
                    else:
                        assert res == "failed"
                        m.failed.append(tid)
        elif op == "lost":
            ids = [t for t, (hw, _) in m.leases.items() if hw == w]
            assert q.worker_lost(w, now) == ids
            m.front(ids)
        elif op == "expire":
            ids = [t for t, (_, dl) in m.leases.items() if dl < now]
            assert q.expire(now) == ids
            m.front(ids)
        elif op == "tick":
            now += rng.choice([0.5, 2.0, 6.0, 11.0])
        elif op == "checkpoint":
            q = roundtrip(q)
            m.front(list(m.leases))

        # invariants, every step
        pend = q.pending_ids()
        assert pend == m.pending
        assert len(set(pend)) == len(pend)
        lease_map = q.workers()
        leased_ids = [t for ids in lease_map.values() for t in ids]
        assert sorted(leased_ids) == sorted(m.leases) and not set(pend) & set(leased_ids)
        for tid, (hw, dl) in m.leases.items():
            lease = q.lease_of(tid)
            assert lease is not None and (lease.worker_id, lease.deadline) == (hw, dl)
        assert set(q.completed_ids) == m.completed
        assert [f.task_id for f in q.failed] == m.failed
        buckets = [set(pend), set(leased_ids), set(q.completed_ids), {f.task_id for f in q.failed}]
        assert sum(len(b) for b in buckets) == len(added) and set().union(*buckets) == set(added)
        assert len(q) == len(pend) + len(leased_ids)
        assert len(completed_true) == len(set(completed_true))
        s = q.stats()
        assert (s["completed"], s["failed"], s["pending"], s["leased"]) == (
            len(m.completed), len(m.failed), len(pend), len(leased_ids))
    for f in q.failed:
        assert f.attempts == max_attempts and f.errors == m.errors[f.task_id]
    # drain: everything left finishes exactly once
    while len(q):
        q.expire(now + 2 * TIMEOUT)
        now += 2 * TIMEOUT
        while (t := q.lease("drain", now)) is not None:
            assert q.complete(t.task_id, "drain", now)
    assert len(q.completed_ids) + len(q.failed) == len(added)


def test_completed_ids_stay_bounded_in_memory_and_in_the_checkpoint() -> None:
    from moerl.loop.work_queue import REMEMBER_COMPLETED

    q = WorkQueue(lease_timeout=10.0, max_attempts=1)
    n = 3 * REMEMBER_COMPLETED
    for i in range(n):
        q.add(task(i))
        assert q.lease("w", 0.0) is not None and q.complete(f"t{i}", "w", 0.0)
    state = q.state_dict()
    assert len(q.completed_ids) == len(state["completed_ids"]) == REMEMBER_COMPLETED
    assert state["counters"]["completed"] == n
    with pytest.raises(ValueError, match="already added"):  # a recent id is still refused
        q.add(task(n - 1))
    old = {**state, "completed_ids": [f"t{i}" for i in range(n)]}  # a checkpoint written before the bound
    q2 = WorkQueue(lease_timeout=10.0, max_attempts=1)
    q2.load_state_dict(old)
    assert list(q2.completed_ids) == [f"t{i}" for i in range(n - REMEMBER_COMPLETED, n)]


# ------------------------------------------------------------------ failed-task records (issue 26 item 9)
def test_failed_records_hold_ids_and_clipped_errors_never_prompts() -> None:
    """A failed task used to be kept whole in every checkpoint: one 10 MB prompt grew controller.pt by its size
    at every save. Its record holds ids, attempts and clipped errors only."""
    from moerl.loop.work_queue import MAX_ERROR_CHARS

    q = WorkQueue(lease_timeout=TIMEOUT, max_attempts=2)
    huge = GroupTask("big", 3, [7] * 2_500_000, 2)
    q.add(huge)
    for k in range(2):
        q.lease("a", float(k))
        q.fail("big", "a", f"ValueError: prompt of {len(huge.prompt_token_ids)} tokens " + "x" * 10**6, float(k))
    state = q.state_dict()
    (record,) = state["failed"]
    assert set(record) == {"task_id", "prompt_index", "attempts", "errors"}
    assert (record["task_id"], record["prompt_index"], record["attempts"]) == ("big", 3, 2)
    assert all(len(e) <= MAX_ERROR_CHARS + 40 and e.startswith("ValueError: prompt of 2500000") for e in record["errors"])
    assert len(json.dumps(state)) < 10_000
    assert [f.task_id for f in roundtrip(q).failed] == ["big"]


def test_failed_records_are_capped_and_counters_count_all() -> None:
    from moerl.loop.work_queue import MAX_FAILED_RECORDS

    q = WorkQueue(lease_timeout=TIMEOUT, max_attempts=1)
    n = 3 * MAX_FAILED_RECORDS
    for i in range(n):
        q.add(task(i))
        q.lease("a", 0.0)
        assert q.fail(f"t{i}", "a", "boom", 0.0) == "failed"
    assert len(q.failed) == MAX_FAILED_RECORDS and q.stats()["failed"] == n
    assert [f.task_id for f in q.failed] == [f"t{i}" for i in range(n - MAX_FAILED_RECORDS, n)]  # the newest
    state = q.state_dict()
    assert len(state["failed"]) == MAX_FAILED_RECORDS and state["counters"]["failed"] == n
    with pytest.raises(ValueError, match="already added"):  # a recent failed id is still refused
        q.add(task(n - 1))
    old = {**state, "failed": [{**task(i).to_dict(), "attempts": 1, "errors": ["e" * 10**5]} for i in range(n)]}
    q2 = roundtrip(q)
    q2.load_state_dict(old)  # a checkpoint written before the bound: whole tasks, every one of them
    assert len(q2.failed) == MAX_FAILED_RECORDS and len(q2.failed[-1].errors[0]) < 10**3


# ------------------------------------------------------------------ inputs that kill their worker (issue 26 item 5)
def test_a_death_with_one_task_held_is_its_attempt_and_fails_it_at_max_attempts() -> None:
    q = queue(2, max_attempts=2)
    assert q.lease("a", 0.0).task_id == "t0"  # type: ignore[union-attr]
    assert q.worker_died("a", 1.0, "its rollout worker died (ActorDiedError)") == (["t0"], [])
    assert q.pending_ids() == ["t0", "t1"] and q.suspects() == ["t0"]
    assert q.lease("b", 2.0).task_id == "t0"  # type: ignore[union-attr]
    requeued, failed = q.worker_died("b", 3.0, "its rollout worker died again")
    assert requeued == [] and [f.task_id for f in failed] == ["t0"]
    [f] = q.failed
    assert (f.task_id, f.attempts) == ("t0", 2) and f.errors == ["its rollout worker died (ActorDiedError)",
                                                                  "its rollout worker died again"]
    assert q.stats()["died"] == 2 and q.stats()["failed"] == 1 and q.suspects() == []
    assert q.pending_ids() == ["t1"]


def test_a_death_with_several_tasks_blames_none_and_runs_each_alone() -> None:
    q = queue(5, max_attempts=1)
    assert lease_ids(q, "a", 3) == ["t0", "t1", "t2"]
    assert lease_ids(q, "b", 1) == ["t3"]
    assert q.worker_died("a", 1.0, "died") == (["t0", "t1", "t2"], [])
    assert all(t["attempts"] == 0 for t in q.state_dict()["pending"]) and q.failed == []
    assert q.suspects() == ["t0", "t1", "t2"] and q.pending_ids() == ["t0", "t1", "t2", "t4"]
    assert q.lease("b", 2.0) is None, "a busy worker took work while suspects wait (it must drain)"
    assert q.lease("c", 2.0).task_id == "t0"  # type: ignore[union-attr]  # an idle one takes a suspect, alone
    assert q.lease("c", 2.0) is None
    assert q.complete("t0", "c", 3.0) and q.suspects() == ["t1", "t2"]  # innocent: done, no longer suspect
    assert q.lease("c", 3.0).task_id == "t1"  # type: ignore[union-attr]
    assert q.complete("t3", "b", 3.0)
    assert q.lease("b", 3.0).task_id == "t2"  # type: ignore[union-attr]  # b drained: it takes the next one
    requeued, failed = q.worker_died("b", 4.0, "died (os._exit)")  # alone: blamed, failed (max_attempts 1)
    assert requeued == [] and [(f.task_id, f.prompt_index) for f in failed] == [("t2", 2)]
    assert [(f.task_id, f.errors) for f in q.failed] == [("t2", ["died (os._exit)"])]
    assert q.complete("t1", "c", 5.0) and q.suspects() == []
    assert lease_ids(q, "b", 1) == ["t4"] and q.lease("b", 5.0) is None  # back to normal leasing


def test_suspects_survive_a_checkpoint() -> None:
    q = queue(3)
    lease_ids(q, "a", 2)
    q.worker_died("a", 1.0, "died")
    q2 = roundtrip(q)
    assert q2.suspects() == ["t0", "t1"] and q2.pending_ids() == ["t0", "t1", "t2"]
    assert q2.lease("b", 0.0).task_id == "t0" and q2.lease("b", 0.0) is None  # type: ignore[union-attr]
