"""A rollout worker's groups of a multi-turn task: one episode per sample, each on a thread of its own, all on the
worker's engine thread (moerl/loop/episode.py plays one; docs/environments.md).

While one episode waits for its environment the engine decodes the others. A preemption aborts the requests in
the engine and every episode not yet in it returns at its next turn: the group goes back with its transcripts
(finish_reason "abort"), which the next worker continues by replay. An episode that failed (its environment raised,
hung past rollout.tool_timeout_s, or its tool died) gets no reward and its error: a failed sample, never a zero.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from moerl.actors.engine_thread import EngineThread
from moerl.loop.episode import Episode, EpisodeLimits, run_episode
from moerl.loop.types import GroupResult, GroupTask
from moerl.rollout.sampling import SamplingParams
from moerl.rollout.types import Completion


def run_episode_group(task: GroupTask, *, episodic: Any, engine: EngineThread, sampling: SamplingParams,
                      seed_of: Callable[[int], int], limits: EpisodeLimits, preempting: threading.Event,
                      timeout_s: float, worker_id: str) -> GroupResult:
    t0 = time.perf_counter()
    start = episodic.episode_at(task.prompt_index)

    def generate_for(i: int):
        def generate(prompt: list[int], params: SamplingParams, prefix: Completion | None) -> Completion:
            if preempting.is_set():  # not in the engine: hand back where it stands
                return dataclasses.replace(prefix, finish_reason="abort")
            fut = engine.submit(prompt, params, f"{task.task_id}/{i}/{time.monotonic_ns()}", prefix=prefix)
            deadline = time.monotonic() + timeout_s
            while True:  # a preemption that came between the check and the submit aborts it here
                try:
                    return fut.result(timeout=1.0)
                except FutureTimeout:
                    if preempting.is_set():
                        engine.abort_all()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"turn of episode {task.task_id}/{i} ran past {timeout_s:g} s") from None
        return generate

    def one(i: int) -> Episode:
        params = dataclasses.replace(sampling, seed=seed_of(i))
        try:
            env = episodic.make_env(dict(start.extras))
        except Exception as exc:  # noqa: BLE001 - the environment's constructor is task code
            partial = task.partials[i] or Completion(f"{task.task_id}/{i}", list(task.prompt_token_ids), loss_mask=[])
            return Episode(partial, "failed", error=f"make_env raised {type(exc).__name__}: {exc}")
        return run_episode(generate_for(i), env, start, params, episodic.renderer, episodic.tokenizer.decode,
                           limits, prefix=task.partials[i], request_id=f"{task.task_id}/{i}")

    with ThreadPoolExecutor(task.group_size, thread_name_prefix="moerl-episode") as pool:
        episodes = list(pool.map(one, range(task.group_size)))
    completions = [e.completion for e in episodes]
    seconds = time.perf_counter() - t0
    if any(e.status == "preempted" for e in episodes):
        return GroupResult(task.task_id, task.prompt_index, worker_id, "preempted", completions, seconds=seconds)
    return GroupResult(task.task_id, task.prompt_index, worker_id, "ok", completions,
                       [e.reward for e in episodes], [e.error for e in episodes], seconds=seconds,
                       episodes=[e.stats() for e in episodes])
