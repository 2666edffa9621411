"""The controller at fleet scale, by simulation: the real loop code (moerl/loop: Controller, WorkQueue,
SampleBuilder) drives simulated engines (moerl/bench/fleet_engines.py), a simulated trainer and weight sync, on a
simulated clock (moerl/bench/fleet_clock.py). Discrete-event: the clock jumps to the next event, nothing sleeps.

What is simulated, and what is real:
- real: leasing, the staleness gate, collecting, heartbeats renewing leases, the ready buffer, sample building
  (GRPO advantages, Sample objects, trajectory rows, the batch's expert counts), the metrics, and the trajectory
  and metrics JSON lines a run writes (encoded here, written to os.devnull);
- simulated: engines (decode pace, batching, weight applies, spot preemptions with hand-back and continuation),
  the trainer (a step takes `step_fixed_s` + its tokens / `train_tok_s`; a publish `publish_s` on the trainer,
  which the controller waits for, as it does), and the transfer (`transfer_s` after the publish the engines
  take the version). Ray itself (calls, pickling, the object store) is not: issue 38 item 3 measures it.

Every sample carries real token lengths (ids, log-probs and per-token versions), so the controller's work per
sample is the real one. The controller's CPU is process CPU time minus the simulator's own, and it is charged to
the simulated clock (fleet_clock.py): at a core fraction near 1 the controller becomes the bottleneck here too.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from moerl.bench.fleet_clock import CpuMeter, Histogram, SimClock
from moerl.bench.fleet_engines import SimFleet
from moerl.bench.fleet_model import EngineModel, length_table
from moerl.loop.controller import Controller, LoopConfig
from moerl.loop.samples import SampleBuilder
from moerl.loop.work_queue import WorkQueue
from moerl.tasks.base import Prompt

LENGTH_KINDS = ("config", "long-tail", "fixed")


@dataclass(frozen=True)
class FleetSimConfig:
    """One simulated run. Defaults: configs/eks-p5en.toml's loop (256 engines, 256 groups x 16, max_staleness 1,
    up to 4,096 new tokens) on 30B-shape engines."""

    engines: int = 256
    groups: int = 100_000  # trained groups: steps = groups / batch_groups
    batch_groups: int = 256
    group_size: int = 16
    max_staleness: int = 1
    inflight_per_engine: int = 32  # rollout.inflight_groups(): 2 x max_batch / group_size
    prompt_len: int = 200
    max_new_tokens: int = 4096
    lengths: str = "config"  # LENGTH_KINDS
    engine: EngineModel = field(default_factory=EngineModel)
    train_tok_s: float = 1.4e6  # the trainer group's tokens per second (see moerl/bench/plan.py for the 30B's)
    step_fixed_s: float = 0.5  # per step beside its tokens (optimizer, collectives)
    publish_s: float = 1.0  # the trainer's publish of a version (the controller waits for it)
    transfer_s: float = 2.0  # publish -> every engine holds the version
    preempt_per_hour: float = 0.0  # spot notices per engine-hour
    heartbeat_s: float = 2.0
    lease_timeout_s: float = 600.0
    trajectories: bool = True  # encode every trained sample's row as the run log does
    moe_layers: int = 48
    experts: int = 128
    seed: int = 0

    def validate(self) -> None:
        for name in ("engines", "groups", "batch_groups", "group_size", "inflight_per_engine", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"fleet simulation: {name} must be >= 1, got {getattr(self, name)}")
        if self.groups < self.batch_groups:
            raise ValueError(f"fleet simulation: groups ({self.groups}) must be at least one batch "
                             f"({self.batch_groups})")
        if self.lengths not in LENGTH_KINDS:
            raise ValueError(f"fleet simulation: lengths {self.lengths!r} is not one of {', '.join(LENGTH_KINDS)}")
        if self.train_tok_s <= 0 or min(self.publish_s, self.transfer_s, self.step_fixed_s, self.preempt_per_hour) < 0:
            raise ValueError("fleet simulation: train_tok_s must be > 0 and the times and rates >= 0")


class SimTask:
    """Prompts of `prompt_len` tokens; no text (the run's trajectory text decoding is not simulated)."""

    def __init__(self, prompt_len: int) -> None:
        self.ids = [11] * prompt_len
        self.tokenizer = None

    def prompt_at(self, index: int) -> Prompt:
        return Prompt(f"p{index}", index, self.ids, "", "")


class SimTrainer:
    """A trainer that is busy for each step's simulated time, then for each publish; `busy_s` sums both."""

    def __init__(self, clock: SimClock, meter: CpuMeter, cfg: FleetSimConfig) -> None:
        self.clock, self.meter, self.cfg = clock, meter, cfg
        self.free_at, self.step_busy_s, self.publish_busy_s = 0.0, 0.0, 0.0
        self.ends: dict[int, float] = {}
        self._next = 0

    def start_rl_step(self, samples: list) -> int:
        with self.meter.sim():
            tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
            start = max(self.clock.t, self.free_at)
            self.free_at = start + self.cfg.step_fixed_s + tokens / self.cfg.train_tok_s
            self.step_busy_s += self.free_at - start
            self._next += 1
            self.ends[self._next] = self.free_at
            return self._next

    def step_end(self, handle: int) -> float:
        return self.ends[handle]

    def pending(self, handle: int) -> list:
        return [handle] if self.ends[handle] > self.clock.t else []

    def done(self, handle: int) -> bool:
        return self.ends[handle] <= self.clock.t

    def result(self, handle: int, step: int) -> dict:
        with self.meter.sim():
            self.clock.t = max(self.clock.t, self.ends.pop(handle))
            return {"loss/policy": 0.0}

    def publish(self) -> float:
        """The publish queued behind the trainer's current work; returns when it ends."""
        start = max(self.clock.t, self.free_at)
        self.free_at = start + self.cfg.publish_s
        self.publish_busy_s += self.cfg.publish_s
        return self.free_at


class SimWeights:
    def __init__(self, clock: SimClock, meter: CpuMeter, trainer: SimTrainer, fleet: SimFleet, transfer_s: float):
        self.clock, self.meter, self.trainer, self.fleet, self.transfer_s = clock, meter, trainer, fleet, transfer_s
        self.version, self.published_at = 0, 0.0

    def publish(self, version: int) -> None:
        with self.meter.sim():
            self.version, self.published_at = version, self.trainer.publish()

    def published(self) -> None:
        with self.meter.sim():
            self.clock.t = max(self.clock.t, self.published_at)

    def deliver(self, wait: bool) -> None:
        with self.meter.sim():
            self.fleet.run_until(self.clock.t)
            self.fleet.schedule_weights(self.version, self.clock.t + self.transfer_s)


class TimedQueue(WorkQueue):
    """The real queue, also timing each task from added (or handed back) to leased."""

    def __init__(self, clock: SimClock, lease_timeout: float) -> None:
        super().__init__(lease_timeout, max_attempts=3)
        self.clock, self.waits, self._since = clock, Histogram(), {}

    def add(self, task) -> None:
        super().add(task)
        self._since[task.task_id] = self.clock.t

    def lease(self, worker_id, now):
        task = super().lease(worker_id, now)
        if task is not None:
            self.waits.add(now - self._since.pop(task.task_id, now))
        return task

    def hand_back(self, task_id, worker_id, partials, now) -> bool:
        back = super().hand_back(task_id, worker_id, partials, now)
        if back:
            self._since[task_id] = now
        return back


@dataclass
class FleetReport:
    cfg: FleetSimConfig
    steps: int
    sim_s: float  # simulated seconds of the measured window (the steps after the first tenth)
    controller_cpu_s: float  # over the measured window
    sim_cpu_s: float  # the simulator's own, whole run
    wall_s: float
    groups_measured: int
    samples_per_s: float
    tokens_per_s: float
    trainer_busy: float  # share of the window the trainer stepped
    trainer_idle_s: float  # per step, in the window: neither stepping nor publishing
    staleness: dict[int, int]  # versions behind -> samples
    collect: Histogram
    group_latency: Histogram
    queue_wait: Histogram
    rss_mb: list[tuple[int, float]]  # (groups trained, resident MB)
    gc_pause_s: float
    gc_collections: list[int]
    counters: dict[str, int]
    fleet_counts: dict[str, int]

    @property
    def cpu_per_group_us(self) -> float:
        return 1e6 * self.controller_cpu_s / max(1, self.groups_measured)

    @property
    def core_fraction(self) -> float:
        return self.controller_cpu_s / self.sim_s if self.sim_s else 0.0

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / n if n else 0.0

    def rss_growth_mb(self) -> float:
        """Resident MB gained from the first tenth of the run to its end (0 when flat)."""
        tenth = [mb for groups, mb in self.rss_mb if groups >= self.cfg.groups // 10]
        return (self.rss_mb[-1][1] - tenth[0]) if tenth else 0.0


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def simulate(cfg: FleetSimConfig) -> FleetReport:
    cfg.validate()
    clock = SimClock()
    meter = CpuMeter(clock)
    queue = TimedQueue(clock, cfg.lease_timeout_s)
    rng = np.random.default_rng(cfg.seed)
    trainer = SimTrainer(clock, meter, cfg)
    fleet = SimFleet(cfg.engines, cfg.engine, length_table(cfg.lengths, cfg.max_new_tokens, cfg.seed),
                     rng.integers(0, 2, 1 << 16).astype(np.float64), queue, clock, meter, trainer.step_end,
                     cfg.preempt_per_hour, cfg.heartbeat_s, cfg.seed + 1)
    weights = SimWeights(clock, meter, trainer, fleet, cfg.transfer_s)
    task = SimTask(cfg.prompt_len)
    builder = SampleBuilder(task, normalize_adv_std=True, num_moe_layers=cfg.moe_layers, num_experts=cfg.experts)
    steps = cfg.groups // cfg.batch_groups
    warm = max(1, steps // 10)
    sink = open(os.devnull, "w")
    staleness: Counter = Counter()
    marks: dict[str, float] = {}
    rss: list[tuple[int, float]] = [(0, _rss_mb())]
    tally = {"samples": 0, "tokens": 0}
    gc_time = {"pause": 0.0, "since": 0.0}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_time["since"] = time.process_time()
        else:
            gc_time["pause"] += time.process_time() - gc_time["since"]

    def on_step(step: int, metrics: dict, rows: list[dict]) -> None:
        if cfg.trajectories:  # what RunLog.log_trajectories and log_step encode per step
            for row in rows:
                sink.write(json.dumps(row) + "\n")
            sink.write(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}) + "\n")
        with meter.sim():
            if step > warm:
                for row in rows:
                    staleness[row["trained_at_version"] - row["versions"][0]] += 1
                    tally["tokens"] += row["prompt_len"] + row["completion_len"]
                tally["samples"] += len(rows)
            if step == warm:
                marks.update(t=clock.t, cpu=meter.controller_s(), busy=trainer.step_busy_s,
                             publish=trainer.publish_busy_s)
            if step % max(1, steps // 20) == 0 or step == steps:
                rss.append((step * cfg.batch_groups, _rss_mb()))

    controller = Controller(LoopConfig(steps=steps, batch_groups=cfg.batch_groups, group_size=cfg.group_size,
                                       max_staleness=cfg.max_staleness, mode="async", stale_policy="drop",
                                       max_inflight_per_worker=cfg.inflight_per_engine),
                            task, queue, fleet, trainer, weights, builder, on_step, now=clock.now)
    gc.callbacks.append(on_gc)
    wall = time.perf_counter()
    try:
        state = controller.run()
    finally:
        gc.callbacks.remove(on_gc)
        sink.close()
    window = clock.t - marks["t"]
    busy = trainer.step_busy_s - marks["busy"]
    publishing = trainer.publish_busy_s - marks["publish"]
    return FleetReport(cfg, steps, window, meter.controller_s() - marks["cpu"], meter.sim_s,
                       time.perf_counter() - wall, (steps - warm) * cfg.batch_groups, tally["samples"] / window,
                       tally["tokens"] / window, busy / window, (window - busy - publishing) / (steps - warm),
                       dict(sorted(staleness.items())), fleet.collect_latency, fleet.group_latency, queue.waits, rss,
                       gc_time["pause"], [s["collections"] for s in gc.get_stats()], dict(state.counters),
                       dict(fleet.counts))
