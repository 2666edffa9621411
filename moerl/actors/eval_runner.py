"""A rollout worker's side of evaluation (moerl/loop/evaluation.py): one eval chunk at fixed weights.

The controller holds the worker first (no new weights reach it), so the engine keeps the eval's version for
the whole chunk; the runner still checks it, before (waiting a bounded time for a delivery in flight) and after
(every token of every sample), and answers "wrong_version" rather than report a mixed eval.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from moerl.actors.engine_thread import EngineThread
from moerl.loop.evaluation import EvalRequest, EvalResult, EvalSet, eval_seed, open_eval_set
from moerl.rollout import SamplingParams
from moerl.tasks.base import Task
from moerl.tasks.scoring import RewardScorer


class EvalRunner:
    def __init__(self, worker_id: str, engine: EngineThread, task: Task, task_name: str, task_options: dict,
                 sampling: SamplingParams, seed: int, timeout_s: float = 600.0, reward_timeout_s: float = 60.0) -> None:
        self.worker_id, self.engine, self.task = worker_id, engine, task
        self.task_name, self.task_options, self.sampling, self.seed = task_name, task_options, sampling, seed
        self.timeout_s, self.reward_timeout_s = timeout_s, reward_timeout_s
        self._sets: dict[str, tuple[EvalSet, RewardScorer]] = {}  # eval.path -> its eval set, opened once

    def _set(self, path: str) -> tuple[EvalSet, RewardScorer]:
        if path not in self._sets:
            eval_set = open_eval_set(self.task, self.task_name, self.task_options, path, self.seed)
            self._sets[path] = eval_set, RewardScorer(eval_set.task, self.reward_timeout_s)  # rewards under a deadline
        return self._sets[path]

    def run(self, req: EvalRequest, preempting: threading.Event) -> EvalResult:
        t0 = time.perf_counter()

        def result(status: str, error: str | None = None, **kw) -> EvalResult:
            return EvalResult(req.eval_id, req.chunk, self.worker_id, status, error=error,  # type: ignore[arg-type]
                              seconds=time.perf_counter() - t0, **kw)

        deadline = time.monotonic() + req.wait_s
        while self.engine.engine.version < req.version and time.monotonic() < deadline and not preempting.is_set():
            time.sleep(0.01)  # the delivery of the eval's weights may still be on its way
        if preempting.is_set():
            return result("preempted")
        if self.engine.engine.version != req.version:
            return result("wrong_version", f"worker holds weights version {self.engine.engine.version}, "
                                           f"the eval needs {req.version}")
        eval_set, scorer = self._set(req.path)
        base = dataclasses.replace(self.sampling, temperature=req.temperature,
                                   max_new_tokens=req.max_new_tokens or self.sampling.max_new_tokens)
        prompts = [eval_set.prompt(i) for i in req.indices]
        futures = [[self.engine.submit(p.prompt_token_ids, dataclasses.replace(base, seed=eval_seed(self.seed, i, j)),
                                       f"{req.eval_id}/{i}/{j}/{time.monotonic_ns()}") for j in range(req.k)]
                   for p, i in zip(prompts, req.indices)]
        if preempting.is_set():  # preempted while submitting: abort these too (queued after the first abort)
            self.engine.abort_all()
        completions = [[f.result(timeout=self.timeout_s) for f in fs] for fs in futures]
        flat = [c for cs in completions for c in cs]
        if any(c.finish_reason == "abort" for c in flat):
            return result("preempted")
        versions = {v for c in flat for v in c.versions}
        if versions - {req.version}:
            return result("wrong_version", f"weights changed during the eval: versions {sorted(versions)}")
        rewards, lengths = [], []
        for prompt, cs in zip(prompts, completions):
            scored = scorer.score(prompt, [c.token_ids for c in cs])
            rewards.append([None if c.finish_reason == "error" else r for c, (r, _) in zip(cs, scored)])
            lengths.append([len(c.token_ids) for c in cs])
        return result("ok", indices=list(req.indices), rewards=rewards, lengths=lengths)
