"""The step watchdog: a run whose step does not advance says so, and stops past `train.step_timeout_s`.

A stuck trainer rank or a rollout that never finishes a group used to stall a run without a line (240 s, then
4 minutes, in the probes of issue 26). The controller's loop never blocks for long (every wait in it is
bounded), so it asks the watchdog on each turn: at each quarter of the timeout without a step the watchdog
warns (`warn`, a line on the console and in error.log) naming what the step waits for; at the timeout it
raises RunFailed, naming it too (exit 1). 0 turns it off.

The clock starts again whenever the step awaited changes (a step finished), and stands still while the caller
says the wait is not a step's (`counting=False`: the run's first rollout workers starting, which
rollout.start_timeout_s bounds): a watchdog that counted from the start of the run ended runs longer than its
timeout, and ended runs whose workers took longer than it to start, before step 1.
"""

from __future__ import annotations

import time
from typing import Callable

from moerl.loop.failures import RunFailed


class StepWatchdog:
    def __init__(self, timeout_s: float, warn: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s < 0:
            raise ValueError(f"train.step_timeout_s must be >= 0 (0 = off), got {timeout_s}")
        self.timeout_s, self.warn, self.clock = timeout_s, warn, clock
        self.advanced()

    def advanced(self) -> None:
        """A step finished (or the run began): the clock starts again."""
        self.since, self.warned, self.step = self.clock(), 0, None

    def idle_s(self) -> float:
        """Seconds the awaited step has been waited for."""
        return self.clock() - self.since

    def check(self, step: int, waiting_for: Callable[[], str], counting: bool = True) -> None:
        """`step` is the number of the step awaited; `waiting_for()` says what it waits for (called only when
        there is something to say). counting=False: this wait is not the step's (the clock stands still)."""
        if not counting or (self.step is not None and step != self.step):
            self.advanced()  # not a step's wait, or a step finished: the clock starts again
        self.step = step
        if self.timeout_s <= 0:
            return
        idle = self.clock() - self.since
        if idle >= self.timeout_s:
            raise RunFailed(f"step {step} did not finish within train.step_timeout_s = {self.timeout_s:g} s; "
                            f"it waits for {waiting_for()}")
        quarter = int(4 * idle // self.timeout_s)
        if quarter > self.warned:
            self.warned = quarter
            self.warn(f"no step for {idle:.0f} s (the run stops at train.step_timeout_s = {self.timeout_s:g} s): "
                      f"step {step} waits for {waiting_for()}")
