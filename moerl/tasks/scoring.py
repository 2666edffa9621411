"""A group's rewards under a deadline: a reward that hangs fails its sample instead of holding its worker.

    scorer = RewardScorer(task, timeout_s=60)
    rewards_and_errors = scorer.score(prompt, [completion_ids, ...])   # [(reward | None, error | None), ...]

A Python call cannot be interrupted from outside, so the rewards of one `score` run on a thread of their own
(daemon, one per call) while the caller waits for each result at most `timeout_s`. A reward past it fails its
sample ("TimeoutError: reward overran ..."); its thread is abandoned: it only ever writes to its own result
queue, and it stops once the hung call returns. The rest of the group is scored on a new thread. Abandoned
threads still running are counted: past `max_hung`, rewards are not started at all (their samples fail at
once), so a reward that never returns cannot pile up threads. The math reward bounds its own work in a child
process (moerl/tasks/math_grader.py); this deadline is the backstop for every reward.
"""

from __future__ import annotations

import queue
import threading

from moerl.tasks.base import REWARD_TIMEOUT, Prompt, Task, safe_reward

MAX_HUNG = 4  # abandoned reward threads still running, past which no reward is started


class RewardScorer:
    def __init__(self, task: Task, timeout_s: float, max_hung: int = MAX_HUNG) -> None:
        if timeout_s <= 0:
            raise ValueError(f"task.reward_timeout_s must be > 0, got {timeout_s}")
        self.task, self.timeout_s, self.max_hung = task, timeout_s, max_hung
        self._hung: list[threading.Thread] = []
        self._lock = threading.Lock()  # `score` runs on several actor threads at once

    def hung(self) -> int:
        with self._lock:
            self._hung = [t for t in self._hung if t.is_alive()]
            return len(self._hung)

    def score(self, prompt: Prompt, completions: list[list[int]]) -> list[tuple[float | None, str | None]]:
        out: list[tuple[float | None, str | None]] = []
        while len(out) < len(completions):
            if self.hung() >= self.max_hung:
                error = (f"{REWARD_TIMEOUT} task.reward_timeout_s = {self.timeout_s:g} s: not started, "
                         f"{self.max_hung} earlier rewards are still running past it")
                return out + [(None, error)] * (len(completions) - len(out))
            results: queue.SimpleQueue = queue.SimpleQueue()
            stop = threading.Event()
            thread = threading.Thread(target=self._run, args=(prompt, completions[len(out):], results, stop),
                                      daemon=True, name="moerl-reward")
            thread.start()
            while len(out) < len(completions):
                try:
                    out.append(results.get(timeout=self.timeout_s))
                except queue.Empty:
                    stop.set()  # the thread takes no further sample once (if ever) this call returns
                    with self._lock:
                        self._hung.append(thread)
                    out.append((None, f"{REWARD_TIMEOUT} task.reward_timeout_s = {self.timeout_s:g} s"))
                    break
        return out

    def _run(self, prompt: Prompt, completions: list[list[int]], results: queue.SimpleQueue,
             stop: threading.Event) -> None:
        for ids in completions:
            if stop.is_set():
                return
            results.put(safe_reward(self.task, prompt, ids))
