"""The Ray side of the loop: the trainer ranks (`RayTrainerGroup`) and the rollout workers (`RayRolloutPool`),
implementing the loop's `TrainerGroup` and `RolloutPool` Protocols (moerl/loop/types.py).

Placement: when the cluster has nodes with a `rollout` resource (spot capacity), rollout workers ask for a
sliver of it and land there, and the trainer ranks are pinned to nodes without it; on one machine both share it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from moerl.actors.capacity import actor_id, waiting_for_capacity
from moerl.actors.respawn import RespawnPolicy
from moerl.actors.rollout_worker import RolloutWorker
from moerl.actors.trainer_actor import TrainerRank, TrainerSpec
from moerl.actors.worker_spec import WorkerSpec
from moerl.checkpoint.deadline import STORAGE_TIMEOUT_S
from moerl.loop.evaluation import EvalRequest, EvalResult
from moerl.loop.types import GroupResult, GroupTask
from moerl.loop.work_queue import WorkQueue
from moerl.startup import StartupStopped, StartupTimeout
from moerl.train.batching import split_by_tokens
from moerl.train.step_metrics import merge_rank_metrics


class TrainerLost(RuntimeError):
    """A trainer rank's process died: the ranks cannot go on without it (they restart together, from a
    checkpoint)."""


def _has_rollout_nodes() -> bool:
    return any(n["Alive"] and n["Resources"].get("rollout", 0) > 0 for n in ray.nodes())


def trainer_lost(refs: list, error: Exception, what: str) -> TrainerLost:
    """The run's one line for a rank that died while `refs` (one per rank, in rank order) were awaited."""
    dead = []
    for i, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead.append(i)
        except Exception:  # noqa: BLE001 - not done, or failed otherwise: not the dead one
            pass
    cause = next((line.strip() for line in str(error).splitlines() if "exit" in line.lower()
                  or "died" in line.lower()), type(error).__name__)
    return TrainerLost(f"trainer rank {', '.join(map(str, dead)) or '?'} died during {what} ({cause})")


class RayTrainerGroup:
    """N trainer ranks forming one torch.distributed group; a step is one call on every rank."""

    def __init__(self, spec: TrainerSpec, num_ranks: int, cpus_per_rank: float, gpus_per_rank: float,
                 start_timeout_s: float = 600.0, stop: Callable[[], bool] = lambda: False) -> None:
        """The ranks are placed, built and joined within start_timeout_s (train.start_timeout_s), else
        StartupTimeout naming the ranks not up and what each asks for; `stop()` (SIGTERM, Ctrl-C) meanwhile ends
        the wait with StartupStopped (moerl/startup.py)."""
        options: dict = {"num_cpus": cpus_per_rank, "num_gpus": gpus_per_rank}
        others = []
        if _has_rollout_nodes():  # keep the trainer off spot capacity: nodes without the `rollout` resource
            others = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("rollout", 0) == 0)
        cls = ray.remote(TrainerRank)
        self.ranks = []
        for r in range(num_ranks):
            rank_options = dict(options)
            if others:  # contiguous blocks of ranks per node, spread over all trainer nodes
                node = others[r * len(others) // num_ranks]
                rank_options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
            self.ranks.append(cls.options(**rank_options).remote(r, num_ranks, spec))
        self.timeout_s = spec.collective_timeout_s
        deadline = time.monotonic() + start_timeout_s
        asks = (f"each asks for {cpus_per_rank:g} CPU and {gpus_per_rank:g} GPU (train.cpus_per_rank, "
                "train.gpus_per_rank)")
        master_ref = [self.ranks[0].rendezvous.remote()]
        wait_up(master_ref, deadline, stop, f"trainer rank 0 placed and built ({asks})", start_timeout_s)
        master = self.get(master_ref, "start-up")[0]  # on rank 0's own node
        joined = [r.join.remote(master) for r in self.ranks]
        wait_up(joined, deadline, stop, f"the {num_ranks} trainer ranks placed, built and joined ({asks})",
                start_timeout_s)
        self.get(joined, "start-up")  # the group is up

    def get(self, refs: list, what: str) -> list:
        """ray.get, with a dead rank named (not a raw ActorDiedError)."""
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.RayActorError as e:
            raise trainer_lost(refs, e, what) from None

    def save_state(self, path: str, use_async: bool, target=None) -> None:
        """Every rank stages its state; the upload goes on in the background (`save_done`). target: the step,
        a moerl.checkpoint.storage.StepTarget, which rank 0 clears before any rank writes."""
        self.get([r.save_state.remote(path, use_async, target) for r in self.ranks], "a checkpoint save")

    def save_done(self) -> list:
        return [r.wait_save.remote() for r in self.ranks]

    def load_state(self, path: str, timeout_s: float = STORAGE_TIMEOUT_S) -> int:
        return self.get([r.load_state.remote(path, timeout_s) for r in self.ranks], "a checkpoint load")[0]

    def set_lr(self, lr: float) -> None:
        self.get([r.set_lr.remote(lr) for r in self.ranks], "set_lr")

    @staticmethod
    def shard(samples: list, num_ranks: int) -> list[list]:
        return split_by_tokens(samples, num_ranks)  # balanced by tokens, not by count

    def sft_step(self, samples: list) -> dict:
        refs = [r.sft_step.remote(s) for r, s in zip(self.ranks, self.shard(samples, len(self.ranks)))]
        return self.result(refs, "sft")

    def start_rl_step(self, samples: list) -> list:
        return [r.rl_step.remote(s) for r, s in zip(self.ranks, self.shard(samples, len(self.ranks)))]

    @staticmethod
    def pending(refs: list) -> list:
        """The ranks' step refs not finished yet."""
        return ray.wait(refs, num_returns=len(refs), timeout=0)[1]

    @staticmethod
    def done(refs: list) -> bool:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def result(self, refs: list, step) -> dict:
        """The step's metrics over every rank; a rank that does not answer within the collective timeout is named."""
        ready, missing = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        if missing:
            late = [i for i, ref in enumerate(refs) if ref in missing]
            raise TimeoutError(f"trainer step {step}: rank(s) {late} did not finish within {self.timeout_s:.0f} s "
                               "(straggler or hang; the others wait in a collective)")
        return merge_rank_metrics(self.get(refs, f"trainer step {step}"))


def wait_up(refs: list, deadline: float, stop: Callable[[], bool], what: str, timeout_s: float,
            wait: Callable | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    """Return once every ref is done (ready or failed: the caller's ray.get names a failure); StartupStopped as
    soon as `stop()` holds; StartupTimeout naming the refs not done (by index, as ranks) at `deadline`."""
    wait = wait or ray.wait
    while True:
        _, missing = wait(refs, num_returns=len(refs), timeout=min(1.0, max(0.0, deadline - clock())))
        if not missing:
            return
        if stop():
            raise StartupStopped(what)
        if clock() >= deadline:
            late = [i for i, ref in enumerate(refs) if ref in missing]
            raise StartupTimeout(f"{what} did not finish within {timeout_s:g} s (train.start_timeout_s): "
                                 f"{len(late)} of {len(refs)} not up ({', '.join(f'rank {i}' for i in late)}); Ray "
                                 f"has {_free_resources()} free: the run stops")


def _free_resources() -> str:
    try:
        free = ray.available_resources()
    except Exception:  # noqa: BLE001 - only for the message
        return "an unknown amount"
    return ", ".join(f"{free.get(k, 0):g} {k}" for k in ("CPU", "GPU"))


@dataclass
class _Worker:
    handle: object
    leaving: bool = False
    last_ok: float = 0.0
    ping_ref: object = None
    inflight: int = 0
    started: bool = False  # answered a ping: its actor is placed and built (capacity allowed it)
    waiting: bool = False  # Ray holds it for a node with room (moerl/actors/capacity.py): no start deadline runs
    where: object = None  # its Location (node, GPUs), from its first ping: which weight forms it can take
    held: bool = False  # running an eval (moerl/loop/evaluation.py): no leases, no new weights
    rejoining: bool = False  # back from an eval: catching up to the newest weights before it leases again
    lost_reason: str = ""  # why it is about to be removed (said in the "worker lost" event)
    worked: bool = False  # returned a group: its loss is not a failed life (moerl/actors/respawn.py)


class RayRolloutPool:
    """M rollout workers; dead ones are removed and replaced while capacity allows, with a backoff and a cap when
    they keep dying before finishing a group (`respawn`, moerl/actors/respawn.py).

    A fleet that waits for capacity: all M are asked for at once, and Ray places each when a node has room (spot
    nodes come one by one). Leases start once `min_workers` are up (rollout.min_workers); the rest join as they
    come, each caught up to the newest weights first. A worker Ray holds for capacity (its own account, read by
    `census`: moerl/actors/capacity.py) has no deadline; one placed has `start_timeout_s` to build and take its
    first weights, else it is a failed start, as is one whose constructor raises. Only when fewer than
    `min_workers` were even placed within `start_timeout_s` does the run stop for capacity.

    on_event(kind, text), kind "worker" or "warning": a worker up, lost, retired or replaced, one line each
    (the run log prints them; moerl/runlog/reporter.py)."""

    def __init__(self, spec: WorkerSpec, target: int, cpus_per_worker: float, gpus_per_worker: float,
                 queue: WorkQueue, heartbeat_s: float = 5.0, heartbeat_timeout_s: float = 60.0,
                 max_inflight_groups: int = 8, start_timeout_s: float = 600.0,
                 on_event: Callable[[str, str], None] | None = None, respawn: RespawnPolicy | None = None,
                 min_workers: int = 1, census: Callable[[list[str]], set[str] | None] = waiting_for_capacity,
                 worker_class: type = RolloutWorker) -> None:
        self.spec, self.target, self.queue = spec, target, queue
        self.min_workers = max(1, min(min_workers, target))
        self.census = census  # actor ids -> those waiting for capacity; None when Ray could not be asked
        self._serving = False  # min_workers have come up (once): leases go out from then on, whatever is lost later
        self._next_census = 0.0
        self._waiting_said = -1  # the waiting count last said in an event
        self._placement_deadline = time.monotonic() + start_timeout_s  # min_workers placed by then, or stop
        self._placed_enough = False  # min_workers were placed at once (a census said so): capacity is not the issue
        self.on_event = on_event or (lambda kind, text: None)
        self.heartbeat_s, self.heartbeat_timeout_s = heartbeat_s, heartbeat_timeout_s
        self.start_timeout_s = start_timeout_s  # a worker not up by then (placed and built) is a failed start
        self.max_start_failures = 3  # workers in a row whose constructor raised: a setup error, stop the run
        self._start_failures = 0
        self.respawn = respawn or RespawnPolicy(max(8, 2 * target), 1.0, 60.0)
        # A group's call holds one actor thread until the group is done: threads for every group the controller
        # may lease, plus some so pings and weight updates never queue behind generation (with 16 threads and 64
        # groups leased, the engine saw 16 groups and each weight update waited for a group to finish).
        options = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker,
                   "max_concurrency": max_inflight_groups + 8, "max_restarts": 0}
        if _has_rollout_nodes():
            options["resources"] = {"rollout": 0.001}
        self.cls, self.options = ray.remote(worker_class), options  # a bench's stub-engine worker: worker_class
        self.asks = (f"{cpus_per_worker:g} CPU, {gpus_per_worker:g} GPU" + (", a rollout node" if "resources" in options
                                                                           else ""))  # for the capacity lines
        self.workers: dict[str, _Worker] = {}
        self._ids = itertools.count()
        self.weights = None  # the run's RayWeightSync: brings a worker that starts late up to date
        for _ in range(target):
            self._spawn()

    def _spawn(self) -> str:
        worker_id = f"rollout-{next(self._ids)}"
        handle = self.cls.options(**self.options, name=f"RolloutWorker-{worker_id}").remote(worker_id, self.spec)
        # Weights come when it first answers (see `unresponsive`), the newest then, not the ones of now.
        self.workers[worker_id] = _Worker(handle, last_ok=time.monotonic(), ping_ref=handle.ping.remote())
        return worker_id

    def ready_ids(self) -> list[str]:
        if not self._serving:  # fewer than rollout.min_workers up so far: no leases yet
            return []
        return [w for w, s in self.workers.items() if s.started and not (s.leaving or s.held or s.rejoining)]

    def inflight(self, worker_id: str) -> int:
        return self.workers[worker_id].inflight

    def alive(self) -> int:
        return sum(w.started for w in self.workers.values())

    def waiting(self) -> int:
        """Workers asked for that Ray has not placed yet: waiting for capacity (a node with room)."""
        return sum(not w.started and w.waiting for w in self.workers.values())

    def fleet_line(self) -> str:
        """`N of M up, K waiting for capacity, J starting` (the last two only when not 0)."""
        waiting = self.waiting()
        starting = len(self.workers) - self.alive() - waiting
        return (f"{self.alive()} of {self.target} up" + (f", {waiting} waiting for capacity" if waiting else "")
                + (f", {starting} starting" if starting else ""))

    def dispatch(self, worker_id: str, task: GroupTask):
        w = self.workers[worker_id]
        w.inflight += 1
        return w.handle.run_group.remote(task)

    def wait(self, inflight: dict, timeout: float, also: list = ()) -> list[tuple[object, GroupResult | None, Exception | None]]:
        """Results that arrived within `timeout`; inflight maps each ref to (worker_id, task_id). Returns
        early, maybe with nothing, when one of the refs in `also` (a training step) is done."""
        refs = list(inflight)
        if not refs and not also:
            time.sleep(timeout)
            return []
        # Wake on the first result (not all of them), then take whatever else is already done.
        first, _ = ray.wait(refs + list(also), num_returns=1, timeout=timeout)
        ready = ray.wait(refs, num_returns=len(refs), timeout=0)[0] if first and refs else []
        out = []
        for ref in ready:
            worker = self.workers.get(inflight[ref][0])
            if worker is not None:
                worker.inflight -= 1
            try:
                out.append((ref, ray.get(ref), None))
                if worker is not None:  # it finished a group: workers can stay up
                    worker.worked = True
                    self.respawn.worked()
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                    ray.exceptions.ObjectLostError) as e:
                if worker is not None:
                    worker.lost_reason = worker.lost_reason or f"died ({type(e).__name__})"
                out.append((ref, None, e))
        return out

    def mark_leaving(self, worker_id: str) -> None:
        if worker_id in self.workers:
            self.workers[worker_id].leaving = True

    def remove(self, worker_id: str) -> bool:
        w = self.workers.pop(worker_id, None)
        if w is None:
            return False
        if w.leaving:
            self.on_event("worker", f"rollout worker {worker_id} retired (preempted; its work was handed back)")
        else:
            self.on_event("worker", f"rollout worker {worker_id} lost: {w.lost_reason or 'removed'}")
        try:
            ray.kill(w.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if not w.leaving:  # raises WorkersKeepDying when no worker stays up (the run ends with its line)
            self.respawn.lost(worker_id, w.lost_reason or "removed", w.worked)
        return True

    def unresponsive(self, now: float) -> list[str]:
        """Ping every worker each heartbeat; one silent past the timeout is lost. Live ones renew their leases.
        A worker not up yet is lost only once placed and not built within start_timeout_s (see the class doc)."""
        self._take_census(now)
        lost = []
        for worker_id, w in list(self.workers.items()):
            if w.ping_ref is not None:
                ready, _ = ray.wait([w.ping_ref], timeout=0)
                if ready:
                    try:
                        answer = ray.get(w.ping_ref)
                        if isinstance(answer, dict) and answer.get("stalled_s", 0.0) > self.heartbeat_timeout_s:
                            w.lost_reason = f"its engine is stuck in one step for {answer['stalled_s']:.0f} s"
                            lost.append(worker_id)  # alive but its engine is stuck in one step: replace it
                            continue
                        w.last_ok = now
                        self.queue.heartbeat(worker_id, now)
                    except ray.exceptions.RayError as e:
                        w.lost_reason = f"{'failed to start' if not w.started else 'died'} ({type(e).__name__})"
                        if not w.started:
                            self._start_failed(worker_id, e)
                        lost.append(worker_id)
                        continue
                    w.ping_ref = None
                    if isinstance(answer, dict) and answer.get("where") is not None:
                        w.where = answer["where"]
                    if not w.started or w.rejoining:  # up, or back from an eval: works once it has the newest weights
                        version = answer["version"] if isinstance(answer, dict) else answer
                        w.ping_ref = (self.weights.catch_up(w.handle, version, w.where)
                                      if self.weights is not None else None)
                        if w.ping_ref is None:
                            if not w.started:
                                self._started(worker_id, w)
                            w.started, w.rejoining = True, False
            if w.ping_ref is None and now - w.last_ok >= self.heartbeat_s:
                w.ping_ref = w.handle.ping.remote()
            if not w.started and w.waiting:
                continue  # waiting for a node: capacity, not a failed start
            if now - w.last_ok > (self.heartbeat_timeout_s if w.started else self.start_timeout_s):
                w.lost_reason = (f"no heartbeat for {now - w.last_ok:.0f} s" if w.started else
                                 f"did not start within {self.start_timeout_s:.0f} s (rollout.start_timeout_s)")
                if not w.started:  # never came up: counted, so a worker that can never start ends the run
                    self._start_failed(worker_id, TimeoutError(
                        f"did not start within {self.start_timeout_s:.0f} s (rollout.start_timeout_s)"))
                lost.append(worker_id)
        return lost

    def _started(self, worker_id: str, w: _Worker) -> None:
        w.started, w.waiting, self._start_failures = True, False, 0
        self.on_event("worker", f"rollout worker {worker_id} up ({self.fleet_line()})")
        if not self._serving and self.alive() >= self.min_workers:
            self._serving = True
            self.on_event("worker", f"{self.alive()} rollout worker{'s' * (self.alive() > 1)} up "
                          f"(rollout.min_workers={self.min_workers}): leases start; {self.fleet_line()}")

    def _take_census(self, now: float) -> None:
        """Ask Ray (once a heartbeat) which workers not up yet wait for capacity; say it when that count changes;
        stop the run when fewer than min_workers were placed within start_timeout_s."""
        pending = {actor_id(w.handle): w for w in self.workers.values() if not w.started}
        if pending and now >= self._next_census:
            self._next_census = now + self.heartbeat_s
            waiting = self.census(list(pending))
            if waiting is not None:  # no answer: deadlines run on elapsed time, as before
                for aid, w in pending.items():
                    w.waiting = aid in waiting
                    if w.waiting:  # its start deadline counts from placement, not from the ask
                        w.last_ok = now
                # Once min_workers were placed together, a later stop is a failed start's to make: a replacement
                # of one that hung is pending for a moment (no process yet) and would read as capacity.
                self._placed_enough |= len(self.workers) - self.waiting() >= self.min_workers
        if self.waiting() != self._waiting_said and (self.waiting() or self._waiting_said > 0):
            self._waiting_said = self.waiting()
            self.on_event("worker", f"rollout workers: {self.fleet_line()}"
                          + (f" (each asks for {self.asks})" if self.waiting() else ""))
        if not (self._serving or self._placed_enough) and now >= self._placement_deadline:
            placed = self.target - self.waiting()  # one placed that hung may be gone and not yet replaced
            if placed < self.min_workers:
                raise RuntimeError(
                    f"only {placed} of {self.target} rollout workers were placed within {self.start_timeout_s:g} s "
                    f"(rollout.start_timeout_s) and rollout.min_workers={self.min_workers} must be up to train: "
                    f"{self.waiting()} wait for capacity (each asks for {self.asks}; Ray has {_free_resources()} "
                    "free): the run stops")

    def _start_failed(self, worker_id: str, error: Exception) -> None:
        """A worker that died in its constructor (or refused its first weights) before it ever started;
        some in a row (a task or model its environment cannot load) end the run instead of respawning forever."""
        if not (getattr(error, "actor_init_failed", False) or isinstance(error, (ray.exceptions.RayTaskError,
                                                                                    TimeoutError))):
            return  # killed while starting (node lost): replaced like any lost worker
        self._start_failures += 1
        if self._start_failures >= self.max_start_failures:
            lines = [line for line in str(error).splitlines() if line.strip()]
            raise RuntimeError(f"{self._start_failures} rollout workers in a row failed to start; the last one "
                               f"({worker_id}) raised: {lines[-1] if lines else type(error).__name__}")

    def replace_missing(self, version: int) -> list[str]:
        """Retire workers that are leaving with nothing in flight, then top the pool back up to its target."""
        retired = [w for w, s in self.workers.items() if s.leaving and s.inflight == 0]
        for worker_id in retired:
            self.remove(worker_id)
        # After losses in a row (workers that died before finishing a group), replacements wait: exponential, capped.
        while len(self.workers) < self.target and self.respawn.wait_s() == 0:
            backoff = (f"; {self.respawn.in_row} lost in a row before finishing a group, it waited "
                       f"{self.respawn.delay():.1f} s" if self.respawn.in_row else "")
            self.on_event("worker", f"starting rollout worker {self._spawn()} to replace a lost one "
                          f"({self.fleet_line()}{backoff})")
        return retired

    def preempt_all(self) -> None:
        """Ask every worker to hand back its in-flight work (graceful shutdown of the run)."""
        for worker_id, w in self.workers.items():
            w.leaving = True
            w.handle.preempt.remote("run shutdown")

    def started_workers(self) -> list[tuple[str, object, object]]:
        """(worker id, actor handle, Location) of the workers that are up (the ones new weights go to); a worker
        held for an eval keeps its version until released."""
        return [(worker_id, w.handle, w.where) for worker_id, w in self.workers.items()
                if w.started and not (w.held or w.rejoining)]

    # ---------------------------------------------------------------- evaluation (moerl/loop/evaluation.py)
    def hold(self, worker_id: str) -> None:
        if worker_id in self.workers:
            self.workers[worker_id].held = True

    def release(self, worker_id: str) -> None:
        """Catch up (through the start-up path of `unresponsive`), then lease again."""
        w = self.workers.get(worker_id)
        if w is not None and w.held:
            w.held, w.rejoining = False, True
            if w.ping_ref is None:
                w.ping_ref = w.handle.ping.remote()

    def run_eval(self, worker_id: str, request: EvalRequest):
        w = self.workers.get(worker_id)
        return None if w is None else w.handle.run_eval.remote(request)

    def wait_eval(self, refs: list, timeout: float) -> list[tuple[object, EvalResult | None, Exception | None]]:
        if not refs:
            return []
        ready = ray.wait(refs, num_returns=len(refs), timeout=0)[0]
        if not ready and timeout > 0:
            ready = ray.wait(refs, num_returns=1, timeout=timeout)[0]
        out = []
        for ref in ready:
            try:
                out.append((ref, ray.get(ref), None))
            except ray.exceptions.RayError as e:  # the worker died (or was killed as lost)
                out.append((ref, None, e))
        return out

    def locations(self) -> list:
        """Every worker's Location, None for one that has not answered yet (its place is unknown)."""
        return [w.where for w in self.workers.values()]
