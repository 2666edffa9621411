"""Overlapped decode: launch decode step N+1 before reading step N's tokens, so the host's bookkeeping of step N
(appending tokens, finish checks, routing, block growth, the next inputs) runs while the device computes N+1.

Shape legend: R rows of a step (its requests), B rows of its batch (table rows 0..n-1), L MoE layers, K top-k.

Every decode step that directly follows another is **planned** before the earlier step's tokens are read
(`DecodePlan`): its rows are the earlier step's rows less those that finish by length there (known in advance),
each at the next position, plus the requests whose prefill ended in this engine step ("joiners": a request
decodes from the step after its prefill, Engine.step), each with a block for its position grown now (a block
does not depend on the token). Its input ids are the earlier step's sampled ids, gathered on the device
(`DecodeBatch.fill_next`; a joiner's comes from the host); a row that sampled one of its stop tokens (a "ghost":
it finished, which the host learns only when it reads the tokens) is turned into a padding row on the device,
so it computes nothing of its own and touches none of its blocks.

Exactness. The engine computes the same forwards with `overlap_decode` on or off: both run every planned step
from its plan (batch rows, width, sampling variant fixed at planning, ghosts as padding rows), and both decide
the same way whether the plan still holds when the step is due (`_usable`: its live rows are the requests to
decode, i.e. none was aborted or preempted, and every block was grown). Overlap only changes *when* a planned
step is launched: before the earlier step is read instead of after. Admissions and prefills in between do not
change a plan (their requests join the one after), and a prefill forward that runs between a step launched
ahead and its read touches other blocks than that step, so their order does not matter. A launch that turns
out not to be the step the engine runs (an abort of one of its rows, new weights, all its rows stopped) is
dropped unread (`stats["overlap_discarded"]`) and the engine runs what it would have run; its only traces are
keys/values at positions a later forward writes before any forward reads them (decode writes only its rows'
own unkeyed blocks, a ghost writes nowhere but the null block), so the tokens, log-probs, versions and routing
are the same bit for bit. A plan whose blocks could not all be grown is not launched ahead: the step then
makes room as without overlap (preempting the newest requests).

On CPU the "launch" runs the forward at once; the same plans, ghosts and discards run, which is what the CPU
tests check. An engine group (expert parallelism) never overlaps: its ranks must run the same forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from moerl.model.transformer import MoECausalLM
from moerl.rollout.decode_graphs import DecodeBatch, DecodeGraphs, HostStaging
from moerl.rollout.engine_config import EngineConfig
from moerl.rollout.kv_cache import PagedKVCache
from moerl.rollout.sampling import sampling_hints
from moerl.rollout.types import StepOutput


class HostCopy:
    """The host copies of one step's outputs: device-to-host copies queued right after the step (into pinned
    memory on CUDA) and an event, so the step can be launched and the next one queued before they are read."""

    def __init__(self, device: torch.device, rows: int, moe_layers: int, top_k: int) -> None:
        pin = device.type == "cuda"
        self.device = device
        self.token_B = torch.zeros(rows, dtype=torch.long, pin_memory=pin)
        self.logprob_B = torch.zeros(rows, dtype=torch.float32, pin_memory=pin)
        self.routing_BLK = torch.zeros(rows, moe_layers, top_k, dtype=torch.int16, pin_memory=pin)
        self.event = torch.cuda.Event() if pin else None
        self.n = 0

    def start(self, token_B: torch.Tensor, logprob_B: torch.Tensor, routing_BLK: torch.Tensor) -> HostCopy:
        """Queue the copies of the first n rows (n = len(token_B))."""
        self.wait()  # whatever it held before has landed (a discarded step's copies may still be queued)
        n = self.n = token_B.shape[0]
        self.token_B[:n].copy_(token_B, non_blocking=True)
        self.logprob_B[:n].copy_(logprob_B, non_blocking=True)
        self.routing_BLK[:n].copy_(routing_BLK.to(torch.int16), non_blocking=True)
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(self.device))
        return self

    def wait(self) -> None:
        """Until the copies (and so the step) are done: the one place the host waits for a decode step."""
        if self.event is not None:
            self.event.synchronize()

    def read(self) -> tuple[list[int], list[float], np.ndarray]:
        self.wait()
        n = self.n
        return self.token_B[:n].tolist(), self.logprob_B[:n].tolist(), self.routing_BLK[:n].numpy()


@dataclass
class LaunchedDecode:
    """A decode step on its way: its rows, the device's sampled ids (the next step's inputs) and host copies."""

    rows: list  # the requests it computes, in order (a planned step's ghosts included: read skips them)
    pos: list[int]  # the position each row writes
    version: int  # the weights it runs with: its tokens carry this version
    token_B: torch.Tensor  # int64 [n] on the device, by table row
    host: HostCopy


@dataclass
class DecodePlan:
    """The next decode step, fixed before the current one's tokens are read (see the module docstring)."""

    rows: list  # the current step's rows that continue unless they sample a stop token, then the joiners
    slots: list[int]  # their table rows (kept: a ghost's request is released before a late launch)
    pos: list[int]  # the position each writes
    stoppable: list[bool]  # whether a stop token ends the row here (it has stop ids, past min_new_tokens)
    host_token: list[int]  # a joiner's input id (sampled by its prefill); -1: the id `prev` sampled
    prev: LaunchedDecode  # the step whose sampled ids are this step's inputs
    grown: bool  # every row got the block of its position without preempting anyone
    width: int  # block table columns to copy: the most blocks of a row
    hints: dict  # sampling variant (decode graph) of the rows, ghosts included

    def alive(self) -> list:
        """Its rows that have not finished: the requests the step computes for."""
        return [r for r in self.rows if r.finish_reason is None]


class DecodeHost(Protocol):
    """What the pipeline reads and calls on the engine that owns it (engine.py's `Engine`, which builds it with
    itself): named here by what is used, so that engine.py imports this module and never the reverse."""

    config: EngineConfig
    device: torch.device
    model: MoECausalLM
    cache: PagedKVCache
    graphs: DecodeGraphs | None
    running: dict  # request id -> request, in admission order
    steps: int
    version: int
    stats: dict[str, int]

    def decode_inputs(self, source: list | DecodePlan, batch: DecodeBatch) -> None: ...

    def decode_forward(self, batch: DecodeBatch, kv_len: int, hints: dict | None = None): ...

    # the engine's own bookkeeping, which a decode step takes part in
    def _make_room(self, reqs: list) -> list: ...

    def _append(self, req, token: int, logprob: float, outputs: dict[str, StepOutput],
                version: int | None = None) -> None: ...


class DecodePipeline:
    """The engine's decode phase: `decode_batch` and `run_decode` (Engine's phases), plus the hooks the engine
    calls where the pipeline must let go of a speculative step (`drain`, `forget`, `drop`)."""

    def __init__(self, engine: DecodeHost, overlap: bool) -> None:
        self.engine, self.overlap = engine, overlap
        config, cache, model = engine.config, engine.cache, engine.model
        self.plan: DecodePlan | None = None
        self.inflight: LaunchedDecode | None = None  # the planned step, launched before its predecessor was read
        # Decode inputs' host buffers, at their largest: every row, 4 ints + a full block table row + stop ids.
        self.staging = HostStaging(engine.device, config.max_batch_size * (4 + cache.width + 4))
        # Two steps are unread at most (the one being read, the next one launched): their host copies alternate.
        self._copies = [HostCopy(engine.device, config.max_batch_size, model.num_moe_layers,
                                 model.config.num_experts_per_tok) for _ in range(2)]
        self._turn = 0

    # ------------------------------------------------------------------ the engine's phases
    def decode_batch(self) -> list:
        """The requests this step decodes (one uncomputed token each), with a block for their next position:
        the plan's live rows when it still holds, else every decoding request after making room (which may
        preempt the newest running requests)."""
        engine = self.engine
        reqs = [r for r in engine.running.values() if r.pending == 1 and r.num_computed > 0 and not r.finish_reason
                and r.decodable_from <= engine.steps]
        if reqs and self._usable(reqs):
            return reqs
        self.drop()
        return engine._make_room(reqs)

    def run_decode(self, reqs: list, outputs: dict[str, StepOutput]) -> None:
        """One decode step over reqs (not empty): launch it (or take the one launched ahead), plan the next one
        and, overlapping, launch it too; then read this one's tokens and do its bookkeeping."""
        if self._usable(reqs):
            ahead = self.inflight is not None
            step = self.inflight if ahead else self._launch_plan(self.plan)
            self.engine.stats["overlap_steps"] += ahead
        else:
            self.drop()
            step = self._launch(reqs, [r.slot for r in reqs], [r.num_computed for r in reqs],
                                max(len(r.blocks) for r in reqs), sampling_hints(reqs), reqs)
        self.plan = self.inflight = None
        plan = self._plan_after(step)
        if plan is not None and self.overlap and plan.grown:
            self.inflight = self._launch_plan(plan)
        self.plan = plan
        self._read(step, outputs)
        if self.plan is not None and not self.plan.alive():  # every row finished in `step`: nothing to run
            self.drop()

    # ------------------------------------------------------------------ letting go
    def drop(self) -> None:
        """Forget the plan; a step launched from it is waited for (its blocks may be freed next) and not read."""
        if self.inflight is not None:
            self.inflight.host.wait()
            self.inflight = None
            self.engine.stats["overlap_discarded"] += 1
        self.plan = None

    def drain(self) -> None:
        """Before new weights: wait for a speculative step (it must not read half-copied weights) and discard it
        (it ran the old ones; the plan stands and runs next step on the new weights, as without overlap)."""
        if self.inflight is not None:
            self.inflight.host.wait()
            self.inflight = None
            self.engine.stats["overlap_discarded"] += 1

    def forget(self, req) -> None:
        """req leaves the running set outside a step (abort, preemption): a plan holding it no longer holds."""
        if self.plan is not None and any(r is req for r in self.plan.rows):
            self.drop()

    # ------------------------------------------------------------------ inside
    def _usable(self, reqs: list) -> bool:
        """Whether the plan is the step to run over reqs: the same requests as its live rows. By construction it
        is whenever it was grown (joiners are planned, aborts and preemptions drop the plan); the comparison
        guards the exactness contract against a request reaching the decode some other way."""
        plan = self.plan
        if plan is None or not plan.grown:
            return False
        alive = plan.alive()
        return len(alive) == len(reqs) and {id(r) for r in alive} == {id(r) for r in reqs}

    def _plan_after(self, step: LaunchedDecode) -> DecodePlan | None:
        """The step after `step`, before its tokens are known: its live rows less those that finish by length
        there, each at its next position, then the requests whose prefill ended in this engine step; each with
        its position's block grown now (in that order; it stops at the first that finds no free block: no
        preemption here, the next step then makes room as without overlap)."""
        engine = self.engine
        rows, pos, stoppable, host_token = [], [], [], []
        for r, p in zip(step.rows, step.pos):
            if r.finish_reason is not None:  # a ghost of `step`
                continue
            made = len(r.generated) + 1  # its tokens once `step`'s is appended
            if made >= r.params.max_new_tokens or len(r.tokens) + 1 >= engine.config.max_seq_len:
                continue
            rows.append(r)
            pos.append(p + 1)
            stoppable.append(bool(r.params.stop_token_ids) and made > r.params.min_new_tokens)
            host_token.append(-1)
        stepped = {id(r) for r in step.rows}
        for r in engine.running.values():  # joiners: their first token, from the prefill, is not a stop
            if r.pending == 1 and r.num_computed > 0 and not r.finish_reason and id(r) not in stepped:
                rows.append(r)
                pos.append(r.num_computed)
                stoppable.append(False)
                host_token.append(r.tokens[-1])
        if not rows:
            return None
        slots = [r.slot for r in rows]
        grown = all(engine.cache.grow(r, p) for r, p in zip(rows, pos))
        return DecodePlan(rows, slots, pos, stoppable, host_token, step, grown, max(len(r.blocks) for r in rows),
                          sampling_hints(rows))

    def _launch_plan(self, plan: DecodePlan) -> LaunchedDecode:
        return self._launch(plan.rows, plan.slots, plan.pos, plan.width, plan.hints, plan)

    def _launch(self, rows: list, slots: list[int], pos: list[int], width: int, hints: dict,
                source) -> LaunchedDecode:
        """Queue one decode forward + sampling over rows (a captured graph, else eagerly) and the copies of its
        outputs; nothing here waits for the device. source: the requests, or the plan (Engine.decode_inputs)."""
        engine = self.engine
        n = max(slots) + 1
        captured = engine.graphs.prepare(n, hints) if engine.graphs is not None else None
        if captured is not None:
            graph, batch, outs = captured
            engine.decode_inputs(source, batch)
            graph.replay()
        else:
            batch = DecodeBatch.empty(n, width, engine.device)
            engine.decode_inputs(source, batch)
            outs = engine.decode_forward(batch, max(pos) + 1, hints)
        token_B, logprob_B, routing_BLK = (t[:n] for t in outs)
        token_B = token_B.clone()  # the next step's inputs: a graph's output buffer is rewritten by its replay
        self._turn ^= 1
        host = self._copies[self._turn].start(token_B, logprob_B, routing_BLK)
        return LaunchedDecode(list(rows), list(pos), engine.version, token_B, host)

    def _read(self, step: LaunchedDecode, outputs: dict[str, StepOutput]) -> None:
        """Wait for step's outputs and do its bookkeeping: routing, computed positions, tokens, finish checks.
        A ghost (finished before this step) is skipped: its extra token is never reported nor counted."""
        engine = self.engine
        tokens, logprobs, routing_BLK = step.host.read()
        live = [(r, p) for r, p in zip(step.rows, step.pos) if r.finish_reason is None]
        slots = [r.slot for r, _ in live]
        engine.cache.store_routing(slots, torch.tensor([[p] for _, p in live]),
                                   torch.from_numpy(routing_BLK[slots])[:, None])
        for req, p in live:
            assert req.num_computed == p, (req.id, req.num_computed, p)
            req.num_computed = p + 1
            engine.cache.computed(req, p)
            engine._append(req, tokens[req.slot], logprobs[req.slot], outputs, step.version)
        engine.stats["decode_tokens"] += len(live)
        engine.stats["decode_steps"] += 1
