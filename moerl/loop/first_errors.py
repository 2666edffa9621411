"""The first failures of a run, said where the user looks: a prompt group that failed for good, a sample whose
reward failed. One empty prompt in nine rows failed 21 groups without a word (the error text was never shown);
the counts were in metrics (`count/groups_failed`, `count/samples_failed`) and nowhere else.

The first `limit` of each kind are warnings with their prompt index, task id and error (the run's reporter
prints them and appends them to <run.dir>/error.log); the next one says that the rest are only counted.
Whether such failures stop the run is moerl/loop/failures.py's (train.max_failed_fraction).
"""

from __future__ import annotations

from typing import Callable

from moerl.loop.types import GroupResult

LIMIT = 3  # failures of each kind said one by one
_CHARS = 300  # of an error's text on the console (error.log and the failed-task records keep more)


def _short(error: str) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " | ".join(lines) if len(lines) <= 2 else f"{lines[0]} | ... | {lines[-1]}"  # a traceback: head and cause
    return text if len(text) <= _CHARS else text[:_CHARS] + "..."


class FirstErrors:
    def __init__(self, warn: Callable[[str], None], limit: int = LIMIT) -> None:
        self.warn, self.limit = warn, limit
        self.said: dict[str, int] = {"groups": 0, "samples": 0}

    def _say(self, kind: str, text: str, counter: str) -> None:
        n = self.said[kind] = self.said[kind] + 1
        if n <= self.limit:
            self.warn(text)
        elif n == self.limit + 1:
            self.warn(f"more {'prompt groups failed' if kind == 'groups' else 'rewards failed'}: only the first "
                      f"{self.limit} are shown; {counter} in metrics.jsonl counts them all")

    def group_failed(self, task_id: str, prompt_index: int, error: str) -> None:
        self._say("groups", f"prompt {prompt_index} ({task_id}) failed for good, never trained: {_short(error)}",
                  "count/groups_failed")

    def group_back(self, result: GroupResult) -> None:
        """A group that came back: the samples whose reward failed (None), each not trained."""
        errors = result.reward_errors or [None] * len(result.rewards)
        for i, (reward, error) in enumerate(zip(result.rewards, errors)):
            if reward is None:
                self._say("samples", f"the reward of prompt {result.prompt_index} ({result.task_id}) sample {i} "
                          f"failed, not trained: {_short(error or 'no reward')}", "count/samples_failed")
