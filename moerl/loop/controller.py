"""The controller (the Ray driver's loop): work queue, staleness gate, policy version, weight sync, metrics.

    prompts ──> WorkQueue ──lease──> RolloutPool (M workers, maybe spot)
                   ^  │  hand back partials (preempted) / worker lost / lease expired: back to the front
                   │  └──────────── finished group ──> ready buffer ──staleness filter──> TrainerGroup (N ranks)
                   │                                                                       │ optimizer step
                   └─────────── new weights (version v+1, WeightSync) <────────────────────┘

What blocks what (async mode): rollout never waits for training; a group is leased only while
`groups leased so far < (version + max_staleness + 1) * batch_groups`, which bounds how old a trained
sample's oldest token can be. Training waits for `batch_groups` finished groups. In sync mode the two
alternate exactly: lease one batch, wait for it, train, publish, repeat. An eval (moerl/loop/evaluation.py)
holds some workers at one version while the rest lease and train on; dynamic sampling
(moerl/loop/dynamic_sampling.py) drops all-equal-reward groups as they arrive and leases more in their place.
Guards: failure shares over their bound and a run that trained nothing stop it (moerl/loop/failures.py); a
step that does not advance is reported, then stops it (moerl/loop/watchdog.py); a task whose attempts kill
their worker is failed like one whose attempts raise (moerl/loop/work_queue.py `worker_died`).

No Ray here: the parts are typed by the Protocols of moerl/loop/types.py (moerl/actors implements them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from moerl.loop.dynamic_sampling import DynamicSampling
from moerl.loop.evaluation import Evaluator
from moerl.loop.failures import FailureWatch
from moerl.loop.first_errors import FirstErrors
from moerl.loop.phases import PhaseClock
from moerl.loop.samples import SampleBuilder
from moerl.loop.types import Checkpoints, GroupResult, GroupTask, RolloutPool, StepInFlight, TrainerGroup, WeightSync
from moerl.loop.watchdog import StepWatchdog
from moerl.loop.work_queue import WorkQueue
from moerl.tasks.base import Task


@dataclass
class LoopConfig:
    steps: int
    batch_groups: int
    group_size: int
    max_staleness: int
    mode: str  # "async" | "sync"
    stale_policy: str  # "drop" | "regenerate"
    max_inflight_per_worker: int
    poll_s: float = 0.05
    deterministic: bool = False  # batches in task-id order, so the optimizer sees the same sample order
    checkpoint_every: int = 0  # save every N steps (with a Checkpoints part); the last step and a stop always
    time_limit_s: float = 0.0  # end (as a graceful stop: in-flight work kept, saved) after this much RL; 0 = none
    step_timeout_s: float = 0.0  # no step for this long ends the run (RunFailed); 0 = off
    max_failed_fraction: float = 1.0  # failed groups or samples over this share of a full window end the run
    failure_window: int = 100  # outcomes (groups, and samples) the share is taken over


@dataclass
class LoopState:
    """Everything the controller owns; saved in checkpoints (issue 5) with the queue."""

    version: int = 0
    step: int = 0
    next_prompt_index: int = 0
    leased_total: int = 0
    ready: list[GroupResult] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=lambda: {
        "groups_done": 0, "groups_failed": 0, "samples_trained": 0, "samples_failed": 0, "stale_dropped": 0,
        "stale_regenerated": 0, "preempted": 0, "workers_lost": 0, "late_results": 0, "groups_filtered": 0,
        "groups_filter_over_limit": 0})


class Controller:
    def __init__(self, cfg: LoopConfig, task: Task, queue: WorkQueue, workers: RolloutPool, trainer: TrainerGroup,
                 weights: WeightSync, builder: SampleBuilder, on_step: Callable[[int, dict, list[dict]], None],
                 checkpoints: Checkpoints | None = None, stop_requested: Callable[[], bool] = lambda: False,
                 evaluator: Evaluator | None = None, dynamic: DynamicSampling | None = None,
                 warn: Callable[[str], None] = lambda text: None) -> None:
        self.cfg, self.task, self.queue, self.workers, self.trainer = cfg, task, queue, workers, trainer
        self.weights, self.builder, self.on_step = weights, builder, on_step
        self.checkpoints = checkpoints
        self.stop_requested = stop_requested  # graceful shutdown (SIGTERM to the driver)
        self.state = LoopState()
        self.clock = PhaseClock()  # where this loop's wall time goes, per step (moerl/loop/phases.py)
        self.inflight: dict = {}  # worker call ref -> (worker_id, task_id)
        self.training: StepInFlight | None = None
        self._saved_step = -1  # the step of the last checkpoint saved
        self.evaluator = evaluator  # evals on held rollout workers (moerl/loop/evaluation.py)
        self.dynamic = dynamic  # DAPO's dynamic sampling (moerl/loop/dynamic_sampling.py)
        self.failures = FailureWatch(cfg.max_failed_fraction, cfg.failure_window)
        self.watchdog = StepWatchdog(cfg.step_timeout_s, warn)
        self.first_errors = FirstErrors(warn)  # the first failures said with their prompts (console, error.log)

    # ------------------------------------------------------------------ the loop
    def run(self) -> LoopState:
        self.weights.publish(self.state.version)
        self.weights.deliver(wait=True)
        if self.evaluator is not None:
            self.evaluator.start_of_run(self.state.step, self.state.version)
        deadline = time.monotonic() + self.cfg.time_limit_s if self.cfg.time_limit_s > 0 else float("inf")
        self.watchdog.advanced()
        while self.state.step < self.cfg.steps:
            if self.stop_requested() or time.monotonic() >= deadline:
                self._graceful_stop()
                break
            if self.checkpoints is not None:
                with self.clock.during("checkpoint"):
                    self.checkpoints.poll()
            self._lease_and_dispatch()
            self._try_start_training()
            self._collect(timeout=self.cfg.poll_s)  # wakes on a finished group or the end of the step
            self._check_workers()
            if self.training is not None and self.trainer.done(self.training.handle):
                self._finish_training()
            self._try_start_training()
            if self.evaluator is not None:
                self.evaluator.poll()
            self.failures.check()
            self.watchdog.check(self.state.step + 1, self._waiting_for)
        if self.evaluator is not None:
            self.evaluator.finish()
        if self.state.step > 0 and self.state.counters["samples_trained"] == 0:
            raise self.failures.nothing_trained(self.state.step)  # never "done" with nothing trained
        return self.state

    def _waiting_for(self) -> str:
        if self.training is not None:
            return f"the trainer, whose step has run for {time.monotonic() - self.training.started_at:.0f} s"
        return (f"rollout: {len(self.state.ready)} of {self.cfg.batch_groups} groups ready, {self.queue.leased()} "
                f"leased, {self.queue.pending()} pending; {self.workers.alive()} of {self.workers.target} rollout "
                "workers up")

    def _try_start_training(self) -> None:
        if self.training is None and self.state.step < self.cfg.steps:
            batch = self._take_batch()
            if batch is not None:
                self._start_training(batch)

    def _gate_open(self) -> bool:
        s, c = self.state, self.cfg
        if c.mode == "sync":  # lease exactly one batch per version, only once the previous one is trained
            return s.leased_total < (s.version + 1) * c.batch_groups
        return s.leased_total < (s.version + c.max_staleness + 1) * c.batch_groups

    def _lease_and_dispatch(self) -> None:
        now = time.monotonic()
        for worker_id in self.workers.ready_ids():
            while self.workers.inflight(worker_id) < self.cfg.max_inflight_per_worker:
                if self.queue.pending() == 0:
                    if not self._gate_open():
                        return
                    self._add_next_prompt()
                task = self.queue.lease(worker_id, now)
                if task is None:  # nothing for this worker now (a suspect waits for it to drain): the next one
                    break
                ref = self.workers.dispatch(worker_id, task)
                self.inflight[ref] = (worker_id, task.task_id)

    def _new_task(self, task_id: str | None, index: int) -> GroupTask:
        """Prompt `index` x group_size samples; task_id None = the task's own id for the prompt."""
        prompt = self.task.prompt_at(index)
        size = self.cfg.group_size
        return GroupTask(task_id=task_id or prompt.task_id, prompt_index=index,
                         prompt_token_ids=prompt.prompt_token_ids, group_size=size, partials=[None] * size)

    def _add_next_prompt(self) -> None:
        self.queue.add(self._new_task(None, self.state.next_prompt_index))
        self.state.next_prompt_index += 1
        self.state.leased_total += 1

    def _collect(self, timeout: float) -> None:
        wake = self.trainer.pending(self.training.handle) if self.training is not None else []
        with self.clock.during("train_wait" if self.training is not None else "idle"):
            arrived = self.workers.wait(self.inflight, timeout, also=wake)
        for ref, result, error in arrived:
            entry = self.inflight.pop(ref, None)
            if entry is None:  # dropped already: its worker was declared lost earlier in this batch
                continue
            worker_id, task_id = entry
            now = time.monotonic()
            if error is not None:  # the actor died (SIGKILL, node lost, an input that killed it): its leases go back
                self._worker_lost(worker_id, now, f"its rollout worker {worker_id} died ({type(error).__name__})")
                continue
            self.queue.heartbeat(worker_id, now)
            if result.status == "preempted":
                self.queue.hand_back(task_id, worker_id, result.completions, now)
                self.state.counters["preempted"] += 1
                self.workers.mark_leaving(worker_id)
            elif result.status == "error":
                if self.queue.fail(task_id, worker_id, result.error or "unknown error", now) == "failed":
                    self._group_failed(task_id, result.prompt_index, result.error or "unknown error")
            elif self.queue.complete(task_id, worker_id, now):
                self.state.counters["groups_done"] += 1
                self.failures.group_back(result)
                self.first_errors.group_back(result)
                self._accept(result)
            else:
                self.state.counters["late_results"] += 1  # lease expired and was re-leased: drop

    def _accept(self, result: GroupResult) -> None:
        if self.dynamic is not None:
            keep, over_limit = self.dynamic.keep(result, self.state.version)
            if not keep:  # all rewards equal: no gradient; its gate slot goes back, so one more prompt is leased
                self.state.counters["groups_filtered"] += 1
                self.state.leased_total -= 1
                return
            self.state.counters["groups_filter_over_limit"] += over_limit
        self.state.ready.append(result)

    def _group_failed(self, task_id: str, prompt_index: int, error: str) -> None:
        self.state.counters["groups_failed"] += 1
        self.state.leased_total -= 1  # never trained: its gate slot goes back (see _take_batch)
        self.failures.group_failed(task_id, prompt_index, error)
        self.first_errors.group_failed(task_id, prompt_index, error)

    def _worker_lost(self, worker_id: str, now: float, cause: str) -> None:
        """The worker is gone: its leases go back, and a task it held alone has its death counted as an attempt
        (work_queue.py `worker_died`), so an input that kills its worker is failed rather than re-run forever."""
        if self.workers.remove(worker_id):
            for record in self.queue.worker_died(worker_id, now, cause)[1]:
                self._group_failed(record.task_id, record.prompt_index, cause)
            self.state.counters["workers_lost"] += 1
            for ref, (wid, _) in list(self.inflight.items()):
                if wid == worker_id:
                    del self.inflight[ref]

    def _check_workers(self) -> None:
        now = time.monotonic()
        for worker_id in self.workers.unresponsive(now):
            self._worker_lost(worker_id, now, f"its rollout worker {worker_id} stopped answering")
        # Expired leases go back to the queue; their calls stay in `inflight`: a result that still comes
        # is dropped as late (the queue no longer holds its lease) and frees its worker's slot.
        self.queue.expire(now)
        for worker_id in self.workers.replace_missing(self.state.version):
            self.queue.worker_lost(worker_id, now)

    def _take_batch(self) -> list[GroupResult] | None:
        """Up to batch_groups finished groups whose oldest token is within the staleness bound."""
        kept = []
        for result in self.state.ready:
            oldest = min((min(c.versions) for c in result.completions if c.versions), default=self.state.version)
            if self.state.version - oldest > self.cfg.max_staleness:
                if self.cfg.stale_policy == "regenerate":
                    # A new id (the queue completes an id once); the same prompt, generated from scratch.
                    self.queue.add(self._new_task(f"{result.task_id}-r", result.prompt_index))
                    self.state.counters["stale_regenerated"] += 1
                else:
                    self.state.counters["stale_dropped"] += 1
                    # Its gate slot goes back, so one more prompt is leased: without it every drop shrinks the
                    # gate's slack for good, and after max_staleness x batch_groups of them the gate stays shut
                    # with less than a batch ready (the demo hung at step 302 after 12 drops).
                    self.state.leased_total -= 1
                continue
            kept.append(result)
        self.state.ready = kept
        if len(kept) < self.cfg.batch_groups:
            return None
        batch, self.state.ready = kept[: self.cfg.batch_groups], kept[self.cfg.batch_groups:]
        if self.cfg.deterministic:
            batch.sort(key=lambda r: r.task_id)
        return batch

    def _start_training(self, batch: list[GroupResult]) -> None:
        samples, rows, stats = self.builder.build(batch, self.state.step, self.state.version)
        self.state.counters["samples_failed"] += stats["samples_failed"]
        self.training = StepInFlight(self.trainer.start_rl_step(samples), batch, samples, rows, stats,
                                     time.monotonic())

    def _finish_training(self, start_next: bool = True) -> None:
        step, self.training = self.training, None
        with self.clock.during("train_wait"):
            metrics = self.trainer.result(step.handle, self.state.step)
        self.state.version += 1
        self.state.step += 1
        self.weights.publish(self.state.version)
        if start_next and self.cfg.mode == "async" and not self._checkpoint_due():
            # The next step queues on the trainer right behind the publish: the trainer does not idle while
            # this process logs, leases and collects. (Not before a checkpoint: it saves this step's state.)
            self._try_start_training()
        with self.clock.during("publish"):
            self.weights.published()
        with self.clock.during("transfer"):  # sync mode: every worker holds the new weights before the next lease
            self.weights.deliver(wait=self.cfg.mode == "sync")
        if self.evaluator is not None and start_next:  # it holds workers at the version just delivered
            self.evaluator.after_step(self.state.step, self.state.version)
        self.state.counters["samples_trained"] += len(step.samples)
        metrics.update(step.stats)
        metrics["time/train_s"] = time.monotonic() - step.started_at
        metrics["time/generate_s"] = sum(g.seconds for g in step.batch) / max(len(step.batch), 1)
        metrics["time/apply_s"] = sum(g.apply_s for g in step.batch)
        metrics.update(self.clock.lap())
        metrics.update({f"queue/{k}": v for k, v in self.queue.stats().items()})
        metrics["queue/pending"] = self.queue.pending()
        metrics.update({f"count/{k}": v for k, v in self.state.counters.items()})
        metrics["workers/alive"], metrics["workers/target"] = self.workers.alive(), self.workers.target
        self.on_step(self.state.step, metrics, step.rows)
        if self._checkpoint_due():
            self.save_checkpoint()
        if self.checkpoints is not None and self.state.step == self.cfg.steps:
            self.checkpoints.wait()

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_due(self) -> bool:
        """Every checkpoint_every steps, and the last step always: a finished run keeps its policy."""
        return self.checkpoints is not None and (self.state.step >= self.cfg.steps or (
            self.cfg.checkpoint_every > 0 and self.state.step % self.cfg.checkpoint_every == 0))

    def state_dict(self) -> dict:
        """Everything the controller owns, in-flight work included (leases become pending on load)."""
        s = self.state
        return {"version": s.version, "step": s.step, "next_prompt_index": s.next_prompt_index,
                "leased_total": s.leased_total, "ready": list(s.ready), "counters": dict(s.counters),
                "queue": self.queue.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.state = LoopState(version=d["version"], step=d["step"], next_prompt_index=d["next_prompt_index"],
                               leased_total=d["leased_total"], ready=list(d["ready"]),
                               counters={**LoopState().counters, **d["counters"]})
        self.queue.load_state_dict(d["queue"])
        # Sync mode leases one batch per version; groups leased but never finished are back in the queue.
        self.state.leased_total = min(self.state.leased_total, self.state.next_prompt_index)
        self._saved_step = self.state.step  # this state is a checkpoint: a stop before the next step saves nothing

    def save_checkpoint(self) -> None:
        with self.clock.during("checkpoint"):
            self.checkpoints.save(self.state.step, self.trainer, self.state_dict())
        self._saved_step = self.state.step

    def _graceful_stop(self) -> None:
        """Preempt every worker so in-flight groups come back as partials, then save and stop."""
        self.workers.preempt_all()
        deadline = time.monotonic() + 30.0
        while self.inflight and time.monotonic() < deadline:
            self._collect(timeout=0.2)
        if self.training is not None:  # let a running optimizer step finish: it is part of the state
            # ... but start no next one: the save must see one cut, the trainer at exactly the saved step and
            # every completed group either trained in it or in the saved ready buffer (issue 17 item 5).
            self._finish_training(start_next=False)
        if self.checkpoints is not None:
            if self._saved_step != self.state.step:  # not just saved by the finished step's own schedule
                self.save_checkpoint()
            self.checkpoints.wait()
