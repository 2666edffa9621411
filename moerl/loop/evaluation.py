"""Evaluation during training: the eval set, when an eval runs, where, and what it reports (`[eval]`).

    step s ends ─> weights v delivered ─> Evaluator.after_step: due? hold `workers` of the ready rollout workers
       (none ready, e.g. before_train while the workers start: tried again at each poll while v is current)
       held worker: takes no leases and no new weights (it keeps v); finishes the groups it had; runs eval chunks
       controller:  leases to the other workers and trains on (async mode); polls the eval each loop pass
    every chunk back ─> release the held workers (they catch up to the newest weights, then lease again)
                     ─> on_eval(s, {"eval/reward", "eval/pass@k", "eval/length", ...}), logged at step s

Why hold workers: the weights change every step, and an eval whose samples mix versions would be neither
exact nor attributable to a step. Holding one worker at v costs the loop that worker's rollouts while the eval
runs; with a single rollout worker, training waits for the eval.

Worker loss: the chunks of a worker that is lost, preempted or found on other weights go back and are re-run on
the eval's other held workers (they hold the same version); when none is left the eval is reported partial
(`eval/partial` = 1, `eval/prompts` = the prompts scored). A run that ends waits up to `timeout_s` for an eval
in flight, then reports what it has.

Exact for greedy: a sample's seed depends on (run seed, prompt index, sample), never on the version or the
worker, and the metrics are summed in prompt order whatever order the chunks come back in, so the same weights
give the same numbers (on an engine whose outputs do not depend on the batch around them: float32 on a CPU; on
a GPU, kernels chosen by batch shape can differ in the last bits).

Eval samples are never trained on: they never enter the work queue, the ready buffer or the sample counters.
The eval set is the task's own data format read from `eval.path` (the task built again with its `path` option
set to it, unshuffled: prompts 0..n-1 are the file's first n rows), or, with no path, the task's held-out
split: an optional `eval_prompt_at(index) -> Prompt` method (and `eval_size`, None = endless).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

from moerl.tasks.base import Prompt, Task, TaskError, derive_seed, load_task, safe_reward

Ref = Any  # an eval call in flight (a Ray ObjectRef in moerl.actors)


# ------------------------------------------------------------------------------------------ the eval set
class EvalSet:
    """The prompts of an eval (`prompt(i)`, i < size; size None = endless) and the reward that scores them."""

    def __init__(self, task: Task, prompt_at: Callable[[int], Prompt], size: int | None) -> None:
        self.task, self._prompt_at, self.size = task, prompt_at, size

    def prompt(self, index: int) -> Prompt:
        return self._prompt_at(index)

    def score(self, prompt: Prompt, completion_ids: list[int]) -> tuple[float | None, str | None]:
        return safe_reward(self.task, prompt, completion_ids)


def _size(task: Task) -> int | None:
    if hasattr(task, "__len__"):
        return len(task)  # type: ignore[arg-type]
    rows = getattr(task, "rows", None)
    return len(rows) if rows is not None else None


def open_eval_set(task: Task, task_name: str, task_options: dict, path: str, seed: int) -> EvalSet:
    """`path`: the task's class built again on that file (same options, unshuffled); "" = the task's held-out
    split. TaskError when neither is possible, naming the fix."""
    if path:
        config_class = getattr(type(task), "config_class", None)
        names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
        if "path" not in names:
            raise TaskError(f"eval.path is set but task {task_name!r} has no 'path' option to read it with; "
                            "leave eval.path empty to evaluate on the task's held-out split")
        options = {**task_options, "path": path, **({"shuffle": False} if "shuffle" in names else {})}
        eval_task = load_task(task_name, options, seed=seed)
        return EvalSet(eval_task, eval_task.prompt_at, _size(eval_task))
    if not hasattr(task, "eval_prompt_at"):
        raise TaskError(f"eval is on but eval.path is empty and task {task_name!r} has no held-out split "
                        "(an eval_prompt_at method): set eval.path to an eval set in the task's data format")
    return EvalSet(task, task.eval_prompt_at, getattr(task, "eval_size", None))  # type: ignore[attr-defined]


def eval_prompt_count(size: int | None, samples: int) -> int:
    """Prompts per eval: `samples`, at most the set's size; 0 = the whole (finite) set."""
    if samples == 0:
        if size is None:
            raise TaskError("eval.samples = 0 (the whole eval set) needs a finite eval set; this one is endless")
        return size
    return samples if size is None else min(samples, size)


def eval_seed(run_seed: int, index: int, sample: int) -> int:
    """The sampling seed of one eval sample: independent of the weights' version and of the worker."""
    return derive_seed("eval", run_seed, index, sample) >> 2


# ------------------------------------------------------------------------------------------ what crosses
@dataclass
class EvalRequest:
    """One chunk of an eval: `k` samples of each prompt in `indices`, on weights of exactly `version`."""

    eval_id: str
    chunk: int
    version: int
    indices: list[int]
    k: int
    temperature: float  # 0 = greedy
    path: str  # eval.path; "" = the task's held-out split
    max_new_tokens: int = 0  # 0 = the worker's rollout.max_new_tokens
    wait_s: float = 60.0  # how long the worker waits for `version` to arrive before answering "wrong_version"


@dataclass
class EvalResult:
    """A chunk's outcome; per prompt of `indices`, per sample: reward (None = failed) and completion length."""

    eval_id: str
    chunk: int
    worker_id: str
    status: Literal["ok", "preempted", "wrong_version", "error"]
    indices: list[int] = field(default_factory=list)
    rewards: list[list[float | None]] = field(default_factory=list)
    lengths: list[list[int]] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


class EvalWorkers(Protocol):
    """The rollout pool's eval side (moerl/actors/pools.py `RayRolloutPool`)."""

    def ready_ids(self) -> list[str]:
        """Workers that may take work now."""

    def hold(self, worker_id: str) -> None:
        """No new leases and no new weights: the worker keeps the version it holds."""

    def release(self, worker_id: str) -> None:
        """Back to work: it catches up to the newest weights, then takes leases again (no-op if gone)."""

    def run_eval(self, worker_id: str, request: EvalRequest) -> Ref | None:
        """Start one eval chunk on the worker (None: the worker is gone); the result arrives through `wait_eval`."""

    def wait_eval(self, refs: list[Ref], timeout: float) -> list[tuple[Ref, EvalResult | None, Exception | None]]:
        """Eval calls that finished within `timeout` (an error when the worker died)."""


# ------------------------------------------------------------------------------------------ metrics
def eval_metrics(results: list[EvalResult], planned: int, k: int) -> dict[str, float]:
    """`eval/*` of the prompts scored. pass@k: per prompt the best of its k rewards (for 0/1 rewards, whether
    any of the k samples is right), averaged over prompts. Summed in prompt order: chunk order never matters."""
    per_prompt = sorted((i, r, n) for res in results for i, r, n in zip(res.indices, res.rewards, res.lengths))
    rewards = [x for _, r, _ in per_prompt for x in r if x is not None]
    best = [max(x for x in r if x is not None) for _, r, _ in per_prompt if any(x is not None for x in r)]
    lengths = [x for _, _, n in per_prompt for x in n]
    metrics = {"eval/prompts": float(len(per_prompt)), "eval/partial": float(len(per_prompt) < planned),
               "eval/samples_failed": float(sum(x is None for _, r, _ in per_prompt for x in r))}
    if rewards:
        metrics["eval/reward"] = sum(rewards) / len(rewards)
        metrics[f"eval/pass@{k}"] = sum(best) / len(best)
    if lengths:
        metrics["eval/length"] = sum(lengths) / len(lengths)
    return metrics


# ------------------------------------------------------------------------------------------ the schedule
@dataclass
class EvalPlan:
    every: int  # evaluate after every N steps; 0 = only before training (with before_train)
    before_train: bool  # evaluate the weights the run starts from
    prompts: int  # prompts per eval (resolved against the set's size: `eval_prompt_count`)
    k: int  # samples per prompt
    temperature: float  # 0 = greedy
    path: str = ""
    workers: int = 1  # rollout workers an eval holds
    chunk: int = 8  # prompts per request (a worker's engine batch / k)
    max_new_tokens: int = 0
    max_attempts: int = 2  # a chunk whose generation fails this often is left out (the eval is partial)
    timeout_s: float = 600.0  # the run's end waits this long for an eval in flight
    per_worker: int = 2  # chunks in flight per held worker: one generating while the next is admitted


@dataclass
class _Running:
    step: int
    version: int
    chunks: list[list[int]]
    held: list[str]
    started_at: float
    pending: list[int] = field(default_factory=list)  # chunk numbers not dispatched (or back from a failure)
    inflight: dict = field(default_factory=dict)  # ref -> (chunk, worker_id)
    done: dict[int, EvalResult] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    failed: list[int] = field(default_factory=list)  # chunks given up on
    lost_workers: int = 0


class Evaluator:
    """Runs evals on held rollout workers while the controller goes on (see the module docstring)."""

    def __init__(self, plan: EvalPlan, pool: EvalWorkers, on_eval: Callable[[int, dict], None],
                 message: Callable[[str], None] = print) -> None:
        self.plan, self.pool, self.on_eval, self.message = plan, pool, on_eval, message
        self.running: _Running | None = None
        self.waiting: tuple[int, int] | None = None  # (step, version) of an eval due while no worker was ready
        self.skipped = 0  # evals due while one was still running, or whose weights left before a worker was ready

    # ---------------------------------------------------------------- hooks of the controller
    def start_of_run(self, step: int, version: int) -> None:
        if self.plan.before_train:
            self._start(step, version)

    def after_step(self, step: int, version: int) -> None:
        """After step `step`'s weights (`version`) were sent to the workers."""
        if self.waiting is not None:  # its weights are gone from the workers
            self.skipped += 1
            self.message(f"eval at step {self.waiting[0]} skipped: no rollout worker was ready while the workers "
                         "held its weights")
            self.waiting = None
        if self.plan.every > 0 and step % self.plan.every == 0:
            self._start(step, version)

    def poll(self, timeout: float = 0.0) -> None:
        if self.waiting is not None:  # e.g. before_train while the workers start
            self._start(*self.waiting)
        run = self.running
        if run is None:
            return
        for ref, result, error in self.pool.wait_eval(list(run.inflight), timeout):
            chunk, worker_id = run.inflight.pop(ref)
            if error is None and result.status == "ok":
                run.done[chunk] = result
            elif error is None and result.status == "error":  # generation failed: retried, then left out
                run.attempts[chunk] = run.attempts.get(chunk, 0) + 1
                if run.attempts[chunk] >= self.plan.max_attempts:
                    run.failed.append(chunk)
                    self.message(f"eval at step {run.step}: chunk {chunk} failed ({result.error}); left out")
                else:
                    run.pending.append(chunk)
            else:  # lost, preempted, or not on the eval's weights: the chunk is re-run on another held worker
                run.pending.append(chunk)
                self._drop_worker(run, worker_id)
        self._dispatch(run)
        if not run.inflight and (not run.pending or not run.held):
            self._finish(run)

    def finish(self) -> None:
        """The run is over: wait (bounded) for the eval in flight, then report it, partial if cut short."""
        self.poll()
        if self.waiting is not None:
            self.skipped += 1
            self.message(f"eval at step {self.waiting[0]} skipped: no rollout worker ready at the end of the run")
            self.waiting = None
        deadline = time.monotonic() + self.plan.timeout_s
        while self.running is not None and time.monotonic() < deadline:
            self.poll(timeout=0.2)
        if self.running is not None:
            self.message(f"eval at step {self.running.step}: not finished within {self.plan.timeout_s:.0f} s "
                         "(eval.timeout_s); reported partial")
            self._finish(self.running)

    # ---------------------------------------------------------------- inside
    def _start(self, step: int, version: int) -> None:
        if self.running is not None:
            self.skipped += 1
            self.message(f"eval at step {step} skipped: the eval of step {self.running.step} still runs "
                         "(raise eval.every or eval.workers)")
            return
        held = self.pool.ready_ids()[: self.plan.workers]
        self.waiting = None if held else (step, version)  # no worker ready yet: tried again at the next poll
        if not held:
            return
        for worker_id in held:
            self.pool.hold(worker_id)
        indices = list(range(self.plan.prompts))
        chunks = [indices[i: i + self.plan.chunk] for i in range(0, len(indices), self.plan.chunk)]
        self.running = _Running(step, version, chunks, held, time.monotonic(), pending=list(range(len(chunks))))
        self._dispatch(self.running)

    def _dispatch(self, run: _Running) -> None:
        busy = {w: 0 for w in run.held}
        for _, worker_id in run.inflight.values():
            busy[worker_id] = busy.get(worker_id, 0) + 1
        p = self.plan
        for worker_id in list(run.held):
            while run.pending and busy[worker_id] < p.per_worker:
                chunk = run.pending.pop(0)
                ref = self.pool.run_eval(worker_id, EvalRequest(f"eval-{run.step}", chunk, run.version,
                                                                run.chunks[chunk], p.k, p.temperature, p.path,
                                                                p.max_new_tokens))
                if ref is None:  # the worker is gone
                    run.pending.insert(0, chunk)
                    self._drop_worker(run, worker_id)
                    break
                run.inflight[ref] = (chunk, worker_id)
                busy[worker_id] += 1

    def _drop_worker(self, run: _Running, worker_id: str) -> None:
        if worker_id in run.held:
            run.held.remove(worker_id)
            run.lost_workers += 1
            self.pool.release(worker_id)

    def _finish(self, run: _Running) -> None:
        self.running = None
        for worker_id in run.held:
            self.pool.release(worker_id)
        metrics = eval_metrics([run.done[c] for c in sorted(run.done)], self.plan.prompts, self.plan.k)
        metrics["eval/seconds"] = time.monotonic() - run.started_at
        metrics["eval/version"] = float(run.version)
        metrics["eval/workers_dropped"] = float(run.lost_workers)  # lost, preempted or on other weights
        self.on_eval(run.step, metrics)
