"""When the rollout pool may replace a lost worker, and when it must give up (no Ray here: unit-tested alone).

A worker lost before it finished any group is a failed life: its replacement waits `backoff_s`, doubled for each
such loss in a row, at most `backoff_max_s`; `max_losses` of them in a row end the run (WorkersKeepDying, one
line with the last cause). A finished group anywhere resets the count: some worker can stay up. A worker that
had finished groups and is then lost (a node gone, a crash after hours) is replaced at once and counts nothing,
so losing a whole node does not stall or end the run. (Before, replacements started at once and for ever: an
input that killed its worker killed 84 of them in 4 minutes, 0 steps, no error.)
"""

from __future__ import annotations

import time
from typing import Callable


class WorkersKeepDying(RuntimeError):
    """No rollout worker stays up long enough to finish a group."""


class RespawnPolicy:
    def __init__(self, max_losses: int, backoff_s: float, backoff_max_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_losses < 1 or backoff_s < 0 or backoff_max_s < backoff_s:
            raise ValueError(f"need max_losses >= 1 and 0 <= backoff_s <= backoff_max_s, got {max_losses}, "
                             f"{backoff_s}, {backoff_max_s}")
        self.max_losses, self.backoff_s, self.backoff_max_s, self.clock = max_losses, backoff_s, backoff_max_s, clock
        self.in_row = 0  # workers lost in a row before finishing a group
        self.not_before = 0.0  # no replacement starts before this (clock time)

    def worked(self) -> None:
        """A worker finished a group."""
        self.in_row, self.not_before = 0, 0.0

    def lost(self, worker_id: str, cause: str, worked: bool) -> None:
        """`worked`: it had finished a group. Raises WorkersKeepDying at `max_losses` failed lives in a row."""
        if worked:
            return
        self.in_row += 1
        if self.in_row >= self.max_losses:
            raise WorkersKeepDying(
                f"no rollout worker stays up: {self.in_row} in a row were lost before finishing a group "
                f"(rollout.max_worker_losses); the last, {worker_id}: {cause}")
        self.not_before = self.clock() + self.delay()

    def delay(self) -> float:
        return 0.0 if self.in_row == 0 else min(self.backoff_max_s, self.backoff_s * 2 ** (self.in_row - 1))

    def wait_s(self) -> float:
        """Seconds until a replacement may start (0: now)."""
        return max(0.0, self.not_before - self.clock())
