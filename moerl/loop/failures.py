"""Runs that train nothing must not end as if they had: failure shares are bounded, and the cause is named.

Two kinds of outcome are watched, each over a sliding window of its last `window` outcomes:

    groups   a prompt group failed for good (its generation failed rollout.max_attempts times, or those
             attempts killed their worker), against the groups that came back
    samples  a sample whose reward failed (raised, overran task.reward_timeout_s, or was not a finite real
             number: it is never trained), against every sample scored

Once a window is full, a share of failures above `max_fraction` (train.max_failed_fraction) stops the run:
`RunFailed`, exit 1, one line naming the kind, the counts and the run's first such failure (its prompt and
error). A run whose steps trained no sample at all fails at its end whatever the shares (a short run's window
may never fill). Before this, prompts over max_seq_len failed 4,820 groups, and a reward that always raised
trained 0 samples, and both runs printed "done" and exited 0.
"""

from __future__ import annotations

from collections import Counter, deque

from moerl.loop.types import GroupResult
from moerl.tasks.base import reward_error_kind


class RunFailed(RuntimeError):
    """The run cannot go on usefully (failures over their bound, no step for too long): one line, exit 1."""


class _Window:
    def __init__(self, size: int) -> None:
        self.outcomes: deque[str] = deque(maxlen=size)  # "" = fine, else the failure's kind
        self.first = ""  # the run's first failure: its prompt and error

    def add(self, kind: str, where: str = "") -> None:
        self.outcomes.append(kind)
        if kind and not self.first:
            self.first = where

    @property
    def failed(self) -> int:
        return sum(1 for k in self.outcomes if k)

    def over(self, max_fraction: float) -> bool:
        return len(self.outcomes) == self.outcomes.maxlen and self.failed > max_fraction * len(self.outcomes)


class FailureWatch:
    def __init__(self, max_fraction: float = 1.0, window: int = 100) -> None:
        if not (0 < max_fraction <= 1 and window >= 1):
            raise ValueError(f"need 0 < max_fraction <= 1 and window >= 1, got {max_fraction}, {window}")
        self.max_fraction = max_fraction
        self.groups, self.samples = _Window(window), _Window(window)
        self.totals = Counter()  # over the whole run: groups back / failed, samples scored / failed

    def group_failed(self, task_id: str, prompt_index: int, error: str) -> None:
        self.totals["groups_failed"] += 1
        self.groups.add("failed", f"prompt {prompt_index} ({task_id}): {error}")

    def group_back(self, result: GroupResult) -> None:
        """A group that came back scored: one outcome for the groups, one per sample for the samples."""
        self.totals["groups_back"] += 1
        self.groups.add("")
        for reward, error in zip(result.rewards, result.reward_errors or [None] * len(result.rewards)):
            self.totals["samples"] += 1
            if reward is None:
                self.totals["samples_failed"] += 1
                text = error or "no reward"
                self.samples.add(reward_error_kind(text), f"prompt {result.prompt_index} ({result.task_id}): {text}")
            else:
                self.samples.add("")

    def check(self) -> None:
        """Raises RunFailed once a full window holds more failures than the bound."""
        bound = f"over train.max_failed_fraction = {self.max_fraction:g}"
        if self.groups.over(self.max_fraction):
            w = self.groups
            raise RunFailed(f"{w.failed} of the last {len(w.outcomes)} prompt groups failed for good ({bound}); "
                            f"the first: {w.first}")
        if self.samples.over(self.max_fraction):
            w = self.samples
            raise RunFailed(f"{w.failed} of the last {len(w.outcomes)} samples could not be trained ({bound}): "
                            f"their reward {self._kinds(w)}; the first: {w.first}")

    def nothing_trained(self, steps: int) -> RunFailed:
        t = self.totals
        first = self.samples.first or self.groups.first
        return RunFailed(f"{steps} step{'s' * (steps != 1)} trained no sample: {t['groups_failed']} prompt groups "
                         f"failed for good and {t['groups_back']} came back, {t['samples_failed']} of their "
                         f"{t['samples']} samples could not be trained" + (f"; the first failure: {first}" if first
                                                                           else ""))

    @staticmethod
    def _kinds(w: _Window) -> str:
        counts = Counter(k for k in w.outcomes if k)
        return ", ".join(f"{kind} ({n})" for kind, n in counts.most_common())
