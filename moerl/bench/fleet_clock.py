"""The simulated time and the measured CPU of `moerl bench fleet` (moerl/bench/fleet_sim.py).

`SimClock` is what the controller reads instead of time.monotonic(); the simulator moves it from event to event,
never sleeping. `CpuMeter` splits the process's CPU time (time.process_time, not wall time: the box is shared)
between the simulated fleet and the controller: every call into a simulated part runs inside `meter.sim()`, and
the controller's share is the rest. On entering the simulation the controller's CPU since the last entry is added
to the simulated clock (`charge`), so a slow controller delays results exactly as it would in a real run: a
controller that needs more than one core falls behind in simulated time too, and the queue latency shows it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager


class SimClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


class CpuMeter:
    def __init__(self, clock: SimClock, charge: bool = True) -> None:
        self.clock, self.charge = clock, charge
        self.sim_s = 0.0  # CPU spent simulating the fleet, trainer and weights
        self._start = time.process_time()
        self._charged = 0.0  # controller CPU already added to the clock
        self._depth = 0

    def controller_s(self) -> float:
        return time.process_time() - self._start - self.sim_s

    @contextmanager
    def sim(self) -> Iterator[None]:
        if self._depth:  # nested: the outer section counts it
            yield
            return
        t0 = time.process_time()
        if self.charge:
            spent = t0 - self._start - self.sim_s
            self.clock.t += spent - self._charged
            self._charged = spent
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            self.sim_s += time.process_time() - t0


class Histogram:
    """Counts of values (seconds or versions) in bins of 1/8 octave from 1 us: bounded memory for any count."""

    BINS = 8 * 40  # up to 2^40 us

    def __init__(self) -> None:
        self.counts = [0] * (self.BINS + 1)  # counts[0]: values below 1 us (0 included)
        self.n, self.total, self.max = 0, 0.0, 0.0

    def add(self, value: float) -> None:
        i = 0 if value < 1e-6 else min(self.BINS, 1 + int(8 * math.log2(value * 1e6)))
        self.counts[i] += 1
        self.n, self.total, self.max = self.n + 1, self.total + value, max(self.max, value)

    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def quantile(self, q: float) -> float:
        """The upper edge of the bin holding quantile q (within 9% above the true value)."""
        need, seen = q * self.n, 0
        for i, c in enumerate(self.counts):
            seen += c
            if c and seen >= need:
                return 0.0 if i == 0 else min(self.max, 2 ** (i / 8) * 1e-6)
        return self.max
