"""The controller's work queue of prompt groups, leased to rollout workers that may vanish.

One `GroupTask` is one prompt x `group_size` samples. Lifecycle (every added task ends in exactly one
of completed / failed, or is still pending / leased):

    add -> PENDING --lease--> LEASED --complete------------------------> COMPLETED (exactly once)
             ^  ^               |----hand_back / worker_lost / expire--> PENDING, at the front
             |  |               |                                        (partials kept, no attempt)
             |  +---------------+----fail, attempts < max_attempts-----> PENDING, at the end
             |                  +----fail, attempts == max_attempts----> FAILED (a record: ids + errors)
             |                  +----worker_died----------------------> PENDING at the front, or FAILED
             +-- load_state_dict: every outstanding lease -> PENDING, at the front

Single-threaded, no Ray, no clocks: every call takes `now` (seconds, any monotonic origin). A lease is
live while `now <= deadline`; after that it is dead even before `expire` sweeps it: `complete`,
`hand_back` and `fail` from its worker are stale (`complete` returns False, the caller drops the result)
and `heartbeat` no longer extends it. Several tasks put back at once keep their lease order, as one
block at the front. A completed id is never completed twice (completing needs a live lease, and a completed
task holds none); re-adding one is refused for the last `REMEMBER_COMPLETED` completed ids. Older ones are
forgotten so that the state (checkpointed with every controller save) stays bounded over a long run: the
controller's data cursor only moves forward, so it never re-adds an old id. Failed tasks are kept the same
way: a record (ids, attempts, clipped errors; never the prompt or its partials) of the last
`MAX_FAILED_RECORDS`, while the counters count every one.

A worker that dies (or stops answering) may have been killed by its input: a reward that calls os._exit, a
prompt that crashes the engine. `worker_died` blames the death on a task only when the worker held that task
alone: it is an attempt of it (failed for good at max_attempts). A worker that held several tasks blames none
of them: each becomes a suspect, and a suspect is leased only to a worker that holds nothing else (workers
drain, taking no new work, while a suspect waits), so its next death is attributable. Without this an input
that kills its worker was re-leased forever (84 workers killed in 4 minutes, 0 steps).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Literal

from moerl.loop.types import GroupTask

STATE_VERSION = 1
REMEMBER_COMPLETED = 4096  # completed ids kept for the duplicate check (and in every checkpoint)
MAX_FAILED_RECORDS = 256  # failed-task records kept (and checkpointed); the `failed` counter counts all
MAX_ERROR_CHARS = 500  # an error text is clipped to this (an exception's message may quote a whole prompt)
COUNTERS = ("completed", "handed_back", "expired", "lost", "retried", "failed", "died")


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


@dataclass
class FailedTask:
    """What is kept of a task that failed for good: enough to name it, never its prompt or partials."""

    task_id: str
    prompt_index: int
    attempts: int
    errors: list[str]  # one per attempt, clipped

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FailedTask:  # also reads a whole GroupTask (older checkpoints)
        return cls(str(d["task_id"]), int(d["prompt_index"]), int(d["attempts"]), [clip(str(e)) for e in d["errors"]])


@dataclass
class Lease:
    task_id: str
    worker_id: str
    deadline: float
    granted_at: float


class WorkQueue:
    """Pending tasks in order, leases by task id, completed ids, failed tasks and counters."""

    def __init__(self, lease_timeout: float, max_attempts: int) -> None:
        if lease_timeout <= 0 or max_attempts < 1:
            raise ValueError(f"need lease_timeout > 0 and max_attempts >= 1, got {lease_timeout}, {max_attempts}")
        self.lease_timeout = float(lease_timeout)
        self.max_attempts = int(max_attempts)
        self._clear()

    def _clear(self) -> None:
        self._tasks: dict[str, GroupTask] = {}  # every pending or leased task
        self._pending: deque[str] = deque()  # ids in lease order; never an id in _leases
        self._leases: dict[str, Lease] = {}  # insertion order = grant order
        self.completed_ids: dict[str, None] = {}  # the most recent completed ids, oldest first (a bounded set)
        self._failed: dict[str, FailedTask] = {}  # the most recent failed tasks, oldest first (bounded)
        self._held: dict[str, dict[str, None]] = {}  # worker id -> the ids it holds leases on, in lease order
        self._earliest = float("inf")  # no lease's deadline is earlier (deadlines only move later): expire's fast path
        self._suspects: dict[str, None] = {}  # pending or leased tasks whose worker died holding others too
        self._isolated: dict[str, str] = {}  # worker id -> the suspect it runs alone
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)

    @property
    def failed(self) -> list[FailedTask]:
        return list(self._failed.values())

    # ---------------------------------------------------------------- queries
    def pending(self) -> int:
        return len(self._pending)

    def leased(self) -> int:
        return len(self._leases)

    def __len__(self) -> int:
        return len(self._tasks)

    def pending_ids(self) -> list[str]:
        return list(self._pending)

    def workers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for lease in self._leases.values():
            out.setdefault(lease.worker_id, []).append(lease.task_id)
        return out

    def lease_of(self, task_id: str) -> Lease | None:
        return self._leases.get(task_id)

    def stats(self) -> dict[str, int]:
        return {**self.counters, "pending": self.pending(), "leased": self.leased()}

    # ---------------------------------------------------------------- transitions
    def suspects(self) -> list[str]:
        return list(self._suspects)

    def add(self, task: GroupTask) -> None:
        tid = task.task_id
        if tid in self._tasks or tid in self.completed_ids or tid in self._failed:
            raise ValueError(f"task {tid!r} was already added")
        self._tasks[tid] = task
        self._pending.append(tid)

    def lease(self, worker_id: str, now: float) -> GroupTask | None:
        """The front pending task, leased to `worker_id` until now + lease_timeout; None if none pending, or
        none for this worker: while a suspect waits, it goes to a worker that holds nothing, and a worker that
        runs one takes nothing else."""
        if not self._pending or worker_id in self._isolated:
            return None
        suspect = next((t for t in self._pending if t in self._suspects), None) if self._suspects else None
        if suspect is not None:
            if self._held.get(worker_id):
                return None  # drain: the suspect waits for a worker with nothing else in flight
            self._pending.remove(suspect)
            self._isolated[worker_id] = tid = suspect
        else:
            tid = self._pending.popleft()
        self._leases[tid] = Lease(tid, worker_id, now + self.lease_timeout, now)
        self._held.setdefault(worker_id, {})[tid] = None
        self._earliest = min(self._earliest, now + self.lease_timeout)
        return self._tasks[tid]

    def _unlease(self, tid: str) -> Lease:
        lease = self._leases.pop(tid)
        held = self._held[lease.worker_id]
        del held[tid]
        if not held:
            del self._held[lease.worker_id]
        if self._isolated.get(lease.worker_id) == tid:
            del self._isolated[lease.worker_id]
        return lease

    def heartbeat(self, worker_id: str, now: float) -> None:
        # The worker's own leases only: a scan of every lease per heartbeat and per result was O(workers x leases)
        # per round (2.8 s of a 30 s simulation of 256 engines, moerl/bench/fleet_sim.py).
        for tid in self._held.get(worker_id, ()):
            lease = self._leases[tid]
            if now <= lease.deadline:
                lease.deadline = now + self.lease_timeout

    def _holds(self, task_id: str, worker_id: str, now: float) -> bool:
        lease = self._leases.get(task_id)
        return lease is not None and lease.worker_id == worker_id and now <= lease.deadline

    def complete(self, task_id: str, worker_id: str, now: float) -> bool:
        """True (once per id) iff `worker_id` holds a live lease on it; else the caller drops the result."""
        if not self._holds(task_id, worker_id, now):
            return False
        self._unlease(task_id)
        del self._tasks[task_id]
        self._suspects.pop(task_id, None)
        self.completed_ids[task_id] = None
        if len(self.completed_ids) > REMEMBER_COMPLETED:
            del self.completed_ids[next(iter(self.completed_ids))]
        self.counters["completed"] += 1
        return True

    def hand_back(self, task_id: str, worker_id: str, partials: list[Any | None], now: float) -> bool:
        """Preemption: the task goes to the front with `partials`; not an attempt. False if stale."""
        if not self._holds(task_id, worker_id, now):
            return False
        task = self._tasks[task_id]
        if len(partials) != task.group_size:
            raise ValueError(f"task {task_id!r}: {len(partials)} partials for group_size {task.group_size}")
        task.partials = list(partials)
        self._requeue_front([task_id], "handed_back")
        return True

    def fail(self, task_id: str, worker_id: str, error: str, now: float) -> Literal["retry", "failed", "stale"]:
        """Counts an attempt: back to the end of the queue, or into `failed` at max_attempts.

        "stale" (nothing changes) when `worker_id` no longer holds a live lease on the task."""
        if not self._holds(task_id, worker_id, now):
            return "stale"
        self._unlease(task_id)
        if self._attempt(task_id, error):
            return "failed"
        self._pending.append(task_id)
        self.counters["retried"] += 1
        return "retry"

    def _attempt(self, task_id: str, error: str) -> bool:
        """Count a failed attempt of the (unleased) task; True when that was its last: it is failed for good."""
        task = self._tasks[task_id]
        task.attempts += 1
        task.errors.append(clip(error))
        if task.attempts < self.max_attempts:
            return False
        del self._tasks[task_id]
        self._suspects.pop(task_id, None)
        self._failed[task_id] = FailedTask(task_id, task.prompt_index, task.attempts, list(task.errors))
        if len(self._failed) > MAX_FAILED_RECORDS:
            del self._failed[next(iter(self._failed))]
        self.counters["failed"] += 1
        return True

    def worker_lost(self, worker_id: str, now: float) -> list[str]:
        """All the worker's leases go to the front (lease order, partials kept); not an attempt."""
        ids = list(self._held.get(worker_id, ()))
        self._requeue_front(ids, "lost")
        return ids

    def worker_died(self, worker_id: str, now: float, cause: str) -> tuple[list[str], list[FailedTask]]:
        """The worker died (or stopped answering) holding its leases: maybe one of them killed it. Held alone, the
        task is blamed: an attempt with `cause` as its error (failed for good at max_attempts). Held with others,
        none is blamed and each becomes a suspect (see the module doc). Returns (ids back at the front, the
        records of the tasks failed for good)."""
        ids = list(self._held.get(worker_id, ()))
        if len(ids) != 1:
            self._suspects.update(dict.fromkeys(ids))
            self._requeue_front(ids, "lost")
            return ids, []
        (tid,) = ids
        self._unlease(tid)
        self.counters["lost"] += 1
        self.counters["died"] += 1  # of the lost leases, those whose worker's death is an attempt
        if self._attempt(tid, cause):
            return [], [self._failed[tid]]
        self._pending.appendleft(tid)  # still a suspect: the next try runs alone again
        self._suspects[tid] = None
        return [tid], []

    def expire(self, now: float) -> list[str]:
        """Leases past their deadline go to the front (lease order); returns their ids. The controller calls this
        every turn: it scans the leases only once the earliest deadline known may have passed."""
        if now <= self._earliest:
            return []
        ids = [t for t, lease in self._leases.items() if lease.deadline < now]
        self._requeue_front(ids, "expired")
        self._earliest = min((lease.deadline for lease in self._leases.values()), default=float("inf"))
        return ids

    def _requeue_front(self, ids: list[str], counter: str) -> None:
        for tid in ids:
            self._unlease(tid)
        self._pending.extendleft(reversed(ids))
        self.counters[counter] += len(ids)

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything, in-flight leases included; JSON-able except the opaque partials (kept as given)."""
        return {"version": STATE_VERSION,
                "pending": [self._tasks[t].to_dict() for t in self._pending],
                "leased": [{**self._tasks[t].to_dict(), "worker_id": lease.worker_id, "deadline": lease.deadline,
                            "granted_at": lease.granted_at} for t, lease in self._leases.items()],
                "completed_ids": list(self.completed_ids),  # at most REMEMBER_COMPLETED, oldest first
                "failed": [asdict(t) for t in self._failed.values()],  # at most MAX_FAILED_RECORDS
                "suspects": list(self._suspects),
                "counters": dict(self.counters)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Replaces all state. Outstanding leases become pending at the front (their workers are gone
        after a restart), in lease order, partials kept; this is not counted as lost/expired."""
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"work queue state version {d.get('version')!r}, expected {STATE_VERSION}")
        self._clear()
        self.completed_ids = dict.fromkeys(d["completed_ids"][-REMEMBER_COMPLETED:])  # older checkpoints: all ids
        records = [FailedTask.from_dict(t) for t in d["failed"][-MAX_FAILED_RECORDS:]]  # older ones: whole tasks
        self._failed = {r.task_id: r for r in records}
        self.counters.update({k: int(v) for k, v in d["counters"].items() if k in self.counters})
        for t in [*d["leased"], *d["pending"]]:
            self.add(GroupTask.from_dict(t))
        self._suspects = dict.fromkeys(t for t in d.get("suspects", []) if t in self._tasks)
