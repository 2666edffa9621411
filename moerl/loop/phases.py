"""Where the controller's wall time goes, step by step: a clock that is always in exactly one phase.

    controller   its own work: leasing, collecting, sample building, logging, checkpoint bookkeeping
    idle         waiting for rollout results with no trainer step running (the loop is rollout-bound)
    train_wait   waiting while a trainer step runs (nothing else to do: the loop is trainer-bound)
    publish      waiting for the trainer to publish the new weights
    transfer     waiting for the rollout workers to take them (sync mode waits; async only sends)
    checkpoint   starting a checkpoint save and committing finished ones

The phases partition the controller's wall time, so per step they add up to the step's wall time. What runs
elsewhere at the same time is measured where it runs and reported with the step: the trainer's forward/backward
and optimizer (`time/fwd_bwd_s`, `time/optimizer_s`), generation per group (`time/generate_s`) and the engine's
pause to apply new weights (`time/apply_s`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

PHASES = ("controller", "idle", "train_wait", "publish", "transfer", "checkpoint")


class PhaseClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.phase = "controller"
        self._since = self._lap_start = clock()
        self.totals = dict.fromkeys(PHASES, 0.0)

    def switch(self, phase: str) -> str:
        """Enter `phase`; returns the phase left."""
        if phase not in self.totals:
            raise ValueError(f"unknown phase {phase!r} (known: {', '.join(PHASES)})")
        now = self.clock()
        self.totals[self.phase] += now - self._since
        left, self.phase, self._since = self.phase, phase, now
        return left

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        left = self.switch(phase)
        try:
            yield
        finally:
            self.switch(left)

    def lap(self) -> dict[str, float]:
        """`time/<phase>_s` since the last lap and `time/step_s`, the wall time they add up to; then restart."""
        self.switch(self.phase)  # book the running phase up to now
        now = self._since
        out = {f"time/{p}_s": t for p, t in self.totals.items()}
        out["time/step_s"] = now - self._lap_start
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._lap_start = now
        return out
