"""The simulated fleet of `moerl bench fleet`: rollout engines as a `RolloutPool` (moerl/loop/types.py) on a
simulated clock, so the real controller drives 256-1,024 of them on one core (moerl/bench/fleet_sim.py wires it).

An engine decodes every admitted sequence one token per step, and a step of `rows` sequences takes
`step_base_s + step_row_s * rows`. All admitted sequences advance together, so an engine keeps one counter
(`decoded`: tokens each admitted sequence gained since the engine started) and a heap of the counter value at
which each sequence ends: an event costs O(log rows), never O(rows). Sequences past `max_batch` wait in a FIFO.
New weights pause decode for `apply_s`; every token carries the version that made it (Completion.versions).
A spot preemption hands back every group the engine holds, finished samples whole and the rest as partial
completions, which the engine that leases the group next continues from; the pool starts a replacement that
comes up `respawn_s` later.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from moerl.bench.fleet_clock import CpuMeter, Histogram, SimClock
from moerl.bench.fleet_model import TOKEN, EngineModel
from moerl.loop.types import GroupResult, GroupTask
from moerl.loop.work_queue import WorkQueue
from moerl.rollout.types import Completion

@dataclass
class _Group:
    ref: int
    task: GroupTask
    worker_id: str
    dispatched: float
    remaining: int
    completions: list = field(default_factory=list)


@dataclass
class _Seq:
    group: _Group
    index: int
    length: int  # tokens the whole completion has (a continued one keeps its prefix)
    prefix: Completion | None
    start: float = 0.0  # the engine's `decoded` when admitted


class SimEngine:
    def __init__(self, worker_id: str, model: EngineModel, version: int, now: float) -> None:
        self.worker_id, self.model = worker_id, model
        self.decoded, self.at = 0.0, now  # tokens per sequence so far, and the time that holds for
        self.active: list[tuple[float, int, _Seq]] = []  # (decoded at its end, tie-break, seq)
        self.waiting: deque[_Seq] = deque()
        self.history: list[tuple[float, int]] = [(0.0, version)]  # (decoded, version) at each switch
        self.groups: dict[int, _Group] = {}
        self.epoch = 0  # bumped whenever the next end moves: older heap events are void
        self.started = self.leaving = self.gone = False
        self.inflight = 0  # dispatched groups whose results the controller has not taken
        self._tie = itertools.count()

    def advance(self, t: float) -> None:
        if t > self.at:
            if self.active:
                self.decoded += (t - self.at) / self.model.step_s(len(self.active))
            self.at = t

    def next_end(self) -> float:
        if not self.active:
            return math.inf
        return self.at + max(0.0, self.active[0][0] - self.decoded) * self.model.step_s(len(self.active))

    def admit(self) -> None:
        while self.waiting and len(self.active) < self.model.max_batch:
            seq = self.waiting.popleft()
            seq.start = self.decoded
            done = len(seq.prefix.token_ids) if seq.prefix is not None else 0
            heapq.heappush(self.active, (self.decoded + seq.length - done, next(self._tie), seq))

    def versions(self, start: float, n: int) -> list[int]:
        """The version of each of the n tokens decoded from counter value `start` on: token k is made while the
        counter goes from start + k to start + k + 1, by the version of the last switch at or before start + k."""
        out: list[int] = []
        for i, (_, version) in enumerate(self.history):
            end = n if i + 1 == len(self.history) else min(n, max(0, math.ceil(self.history[i + 1][0] - start - 1e-9)))
            if end > len(out):
                out += [version] * (end - len(out))
        return out

    def completion(self, seq: _Seq, tokens: int, finished: bool) -> Completion:
        """Sequence `seq` after `tokens` tokens on this engine, its prefix (a handed-back partial) included."""
        p = seq.prefix
        head_ids, head_lp, head_v = (p.token_ids, p.logprobs, p.versions) if p is not None else ([], [], [])
        return Completion(f"{seq.group.task.task_id}/{seq.index}", seq.group.task.prompt_token_ids,
                          head_ids + [TOKEN] * tokens, head_lp + [-1.0] * tokens,
                          head_v + self.versions(seq.start, tokens), finish_reason="stop" if finished else None)

    def trim_history(self) -> None:
        """Forget version switches older than every admitted sequence's start (bounded memory)."""
        if len(self.history) > 16:
            oldest = min((s.start for _, _, s in self.active), default=self.decoded)
            keep = max(i for i, (at, _) in enumerate(self.history) if at <= oldest)
            del self.history[:keep]


class SimFleet:
    """The `RolloutPool` of simulated engines. `results` holds finished groups until the controller takes them."""

    def __init__(self, target: int, model: EngineModel, lengths: np.ndarray, rewards: np.ndarray,
                 queue: WorkQueue, clock: SimClock, meter: CpuMeter, step_end: Callable[[object], float],
                 preempt_per_hour: float, heartbeat_s: float, seed: int) -> None:
        self.target, self.model, self.lengths, self.rewards = target, model, lengths, rewards
        self.queue, self.clock, self.now, self.meter = queue, clock, clock.now, meter
        self.step_end = step_end  # a trainer step's handle -> when it ends (what `wait` also wakes on)
        self.collect_latency = Histogram()  # a group back on its engine -> the controller has it
        self.group_latency = Histogram()  # dispatched -> the controller has it
        self.preempt_rate = preempt_per_hour / 3600.0
        self.heartbeat_s, self._next_heartbeat = heartbeat_s, heartbeat_s
        self.rng = np.random.default_rng(seed)
        self.engines: dict[str, SimEngine] = {}
        # (time, tie, kind, worker id, epoch): kind "up", "preempt", "end" (void unless epoch is the engine's), or
        # "weights" (its epoch slot holds the version)
        self.events: list[tuple[float, int, str, str, int]] = []
        self.results: dict[int, tuple[GroupResult, float, float]] = {}  # ref -> (result, dispatched, came back)
        self.version = 0  # the newest delivered
        self.counts = {"preempted": 0, "spawned": 0}
        self._tie, self._ids, self._refs = itertools.count(), itertools.count(), itertools.count()
        for _ in range(target):
            self._spawn(delay=0.0)

    # ------------------------------------------------------------------ the event loop
    def _push(self, t: float, kind: str, worker_id: str, epoch: int = 0) -> None:
        heapq.heappush(self.events, (t, next(self._tie), kind, worker_id, epoch))

    def _spawn(self, delay: float) -> None:
        wid = f"w{next(self._ids)}"
        self.engines[wid] = SimEngine(wid, self.model, self.version, self.now())
        self.counts["spawned"] += 1
        self._push(self.now() + delay, "up", wid)

    def next_event(self) -> float:
        while self.events:
            t, _, kind, wid, epoch = self.events[0]
            if kind == "weights":
                return t
            e = self.engines.get(wid)
            if e is not None and not e.gone and (kind != "end" or epoch == e.epoch):
                return t
            heapq.heappop(self.events)  # void: its engine is gone or its end moved
        return math.inf

    def run_until(self, t: float) -> None:
        """Every event up to time t, in order."""
        while self.next_event() <= t:
            when, _, kind, wid, epoch = heapq.heappop(self.events)
            if kind == "weights":
                self.deliver(epoch, when)
                continue
            e = self.engines[wid]
            if kind == "up":
                e.started = True
                e.advance(when)
                e.history = [(e.decoded, self.version)]
                if self.preempt_rate > 0:
                    self._push(when + self.rng.exponential(1 / self.preempt_rate), "preempt", wid)
            elif kind == "preempt":
                self._preempt(e, when)
            else:
                self._finish_sequences(e, when)

    def _reschedule(self, e: SimEngine) -> None:
        e.epoch += 1
        if e.active:
            self._push(e.next_end(), "end", e.worker_id, e.epoch)

    def _finish_sequences(self, e: SimEngine, t: float) -> None:
        e.advance(t)
        while e.active and e.active[0][0] <= e.decoded + 1e-6:
            _, _, seq = heapq.heappop(e.active)
            g = seq.group
            g.completions[seq.index] = e.completion(seq, round(e.decoded - seq.start), finished=True)
            g.remaining -= 1
            if g.remaining == 0:
                del e.groups[g.ref]
                self._result(g, "ok", t)
        e.admit()
        e.trim_history()
        self._reschedule(e)

    def _result(self, g: _Group, status: str, t: float) -> None:
        task = g.task
        base = task.prompt_index * task.group_size
        rewards = [float(self.rewards[(base + i) % len(self.rewards)]) for i in range(task.group_size)]
        self.results[g.ref] = (GroupResult(task.task_id, task.prompt_index, g.worker_id, status, g.completions,
                                           rewards if status == "ok" else [], [None] * len(rewards)), g.dispatched, t)

    def _preempt(self, e: SimEngine, t: float) -> None:
        """The spot notice: every group goes back with what it has; the engine decodes no more."""
        e.advance(t)
        self.counts["preempted"] += 1
        for _, _, seq in e.active:
            seq.group.completions[seq.index] = e.completion(seq, round(e.decoded - seq.start), finished=False)
        for seq in e.waiting:
            seq.group.completions[seq.index] = seq.prefix
        for g in e.groups.values():
            self._result(g, "preempted", t)
        e.groups.clear()
        e.active.clear()
        e.waiting.clear()
        e.gone = True  # its node is reclaimed: a group dispatched to it from now on comes straight back

    def schedule_weights(self, version: int, t: float) -> None:
        """Every engine takes `version` at time t (the transfer's end)."""
        self._push(t, "weights", "", version)

    def deliver(self, version: int, t: float) -> None:
        """Every started engine takes `version` at time t: decode pauses apply_s."""
        self.version = version
        for e in self.engines.values():
            if e.started and not e.gone:
                e.advance(t)
                e.history.append((e.decoded, version))
                e.trim_history()  # an idle engine finishes nothing: trimmed only at ends, its history grew per version
                e.at = max(e.at, t) + self.model.apply_s
                self._reschedule(e)

    # ------------------------------------------------------------------ RolloutPool
    def ready_ids(self) -> list[str]:
        return [w for w, e in self.engines.items() if e.started and not e.leaving]

    def inflight(self, worker_id: str) -> int:
        return self.engines[worker_id].inflight

    def alive(self) -> int:
        return sum(e.started for e in self.engines.values())

    def wait(self, inflight: dict, timeout: float, also: list = ()) -> list[tuple[int, GroupResult, None]]:
        """Run the simulation to the first finished group, the end of a step in `also`, or the timeout; then
        every group finished by then (as the Ray pool's wait: wake on the first, take what else is done)."""
        with self.meter.sim():
            stop = min(self.clock.t + timeout, min((self.step_end(h) for h in also), default=math.inf))
            while not self.results:
                t = self.next_event()
                if t > stop:
                    self.clock.t = max(self.clock.t, stop)
                    break
                self.clock.t = max(self.clock.t, t)
                self.run_until(self.clock.t)
            out = []
            for ref, (result, dispatched, back) in self.results.items():
                if ref in inflight:  # else dropped: its worker was declared lost
                    out.append((ref, result, None))
                    self.collect_latency.add(self.clock.t - back)
                    self.group_latency.add(self.clock.t - dispatched)
                    e = self.engines.get(result.worker_id)
                    if e is not None:
                        e.inflight -= 1
            self.results.clear()
            return out

    def dispatch(self, worker_id: str, task: GroupTask) -> int:
        with self.meter.sim():
            return self._dispatch(worker_id, task)

    def _dispatch(self, worker_id: str, task: GroupTask) -> int:
        self.run_until(self.now())
        e = self.engines[worker_id]
        e.inflight += 1
        ref = next(self._refs)
        g = _Group(ref, task, worker_id, self.now(), 0, list(task.partials))
        if e.gone:  # noticed, not yet marked leaving by the controller: the worker hands it straight back
            self._result(g, "preempted", self.now())
            return ref
        e.advance(self.now())
        base = task.prompt_index * task.group_size
        for i, partial in enumerate(task.partials):
            if partial is not None and partial.finish_reason is not None:
                continue  # finished before a hand-back: kept as it is
            length = int(self.lengths[(base + i) % len(self.lengths)])
            e.waiting.append(_Seq(g, i, length, partial))
            g.remaining += 1
        e.groups[ref] = g
        if g.remaining == 0:
            del e.groups[ref]
            self._result(g, "ok", self.now())
        e.admit()
        self._reschedule(e)
        return ref

    def mark_leaving(self, worker_id: str) -> None:
        if worker_id in self.engines:
            self.engines[worker_id].leaving = True

    def remove(self, worker_id: str) -> bool:
        return self.engines.pop(worker_id, None) is not None

    def unresponsive(self, now: float) -> list[str]:
        """No engine goes silent here; each heartbeat renews the live engines' leases, as the Ray pool does."""
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.heartbeat_s
            for wid, e in self.engines.items():
                if e.started and not e.gone:
                    self.queue.heartbeat(wid, now)
        return []

    def replace_missing(self, version: int) -> list[str]:
        with self.meter.sim():
            return self._replace_missing()

    def _replace_missing(self) -> list[str]:
        retired = [w for w, e in self.engines.items() if e.leaving and e.inflight == 0]
        for wid in retired:
            del self.engines[wid]
        while len(self.engines) < self.target:
            self._spawn(delay=self.model.respawn_s)
        return retired

    def preempt_all(self) -> None:
        for e in list(self.engines.values()):
            if not e.gone:
                self._preempt(e, self.now())
