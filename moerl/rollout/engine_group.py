"""An expert-parallel engine group: P ranks in one torch.distributed group, each an `Engine` over its own requests.

    model = build_model(arch, expert_parallel_group=group, dispatcher="all_to_all")   # or load_pretrained(...)
    engine = EngineGroup(model, EngineConfig(...), group=group)
    completions = engine.generate(my_prompts, params)      # collective: every rank calls it, maybe with none

Rank r holds experts [r*E/P, (r+1)*E/P) and a full copy of the dense layers (embeddings, attention, norms,
lm_head): data-parallel attention with expert-parallel MoE layers, as SGLang's DP-attention + EP. Each rank
admits, schedules and samples its own requests over its own paged KV cache, exactly as a single Engine does.
Every MoE layer's dispatch/combine is a collective over the group, so the ranks must run the same sequence of
forwards. Each step:

    admit (local)
    agree: P = max over ranks of this rank's prefill forwards    (one small all_reduce)
    run own prefill forwards, then P - own empty forwards
    finish (local)
    agree: does any rank decode?                                 (one small all_reduce)
    run own decode forward, or an empty one when another rank decodes
    finish (local)

An empty forward runs every MoE block, in layer order, on 0 tokens: it sends nothing but still receives,
computes and returns the rows the other ranks route to this rank's experts. The dense layers have no partner
on other ranks, so it skips them.

Not supported yet with P > 1: CUDA-graph decode (turned off here: the all_to_all dispatcher reads its splits
on the host, which a graph cannot capture; symm_mem could be captured, untested), overlapped decode (turned off:
a rank may launch a step ahead and then discard it, and its peers would have to run that forward too; the
group's all_reduces each step are host syncs anyway) and deterministic mode (its rescoring forward at release
would need matching across ranks too; refused).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from moerl.model.moe import is_expert_param
from moerl.model.transformer import MoECausalLM
from moerl.rollout.engine import Engine, run_to_completion
from moerl.rollout.engine_config import EngineConfig
from moerl.rollout.sampling import SamplingParams
from moerl.rollout.types import Completion, StepOutput

log = logging.getLogger(__name__)


class EngineGroup:
    """This rank's member of an expert-parallel engine group. `step`, `generate`, `any_unfinished` are
    collectives (every rank calls them, in the same order); `submit`, `abort`, `update_weights` are local."""

    def __init__(self, model: MoECausalLM, config: EngineConfig | None = None, *,
                 group: dist.ProcessGroup | None = None, version: int = 0) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        config = config or EngineConfig()
        for block in model.moe_blocks:
            if block.dispatcher.world_size != self.size:
                raise ValueError(f"the model's experts are split over {block.dispatcher.world_size} ranks, the engine "
                                 f"group has {self.size}: build or load it with expert_parallel_group=<this group>")
        if self.size > 1 and config.deterministic:
            raise ValueError("EngineConfig.deterministic is not supported with expert parallelism (ep_size > 1) yet")
        if self.size > 1 and (config.cuda_graphs or config.overlap_decode is not False):
            # see the module docstring; overlapped decode launches steps it may discard, and every rank must run
            # the same forwards: a group decodes one step at a time
            config = dataclasses.replace(config, cuda_graphs=False, overlap_decode=False)
        self.engine = Engine(model, config, version=version, group_member=True)
        # NCCL reduces device tensors only; gloo host tensors.
        self._agree_device = self.engine.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        self.stats = self.engine.stats
        self.stats["empty_forwards"] = 0

    # ------------------------------------------------------------------ local
    def submit(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
               prefix: Completion | None = None) -> str:
        return self.engine.submit(prompt, params, request_id=request_id, prefix=prefix)

    def abort(self, request_id: str) -> Completion:
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Copy new weights in place. Expert tensors may come whole ([num_experts, ...], as an unsplit trainer
        publishes them): this rank keeps its slice. Every rank calls it with the same version."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        E = self.engine.model.config.num_experts
        local = self.engine.model.moe_blocks[0].dispatcher.local_expert_slice if self.size > 1 else slice(None)
        self.engine.update_weights(
            ((name, t[local] if self.size > 1 and is_expert_param(name) and t.shape[0] == E else t)
             for name, t in items), version)

    # ------------------------------------------------------------------ collective
    def any_unfinished(self) -> bool:
        """Whether any rank has work left (collective)."""
        return bool(self._agree_max([int(self.engine.has_unfinished())])[0])

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One step of Engine.step on every rank, its forwards matched across ranks (collective)."""
        engine = self.engine
        outputs = engine.start_step()
        batches = engine.prefill_batches()
        (num_prefill,) = self._agree_max([len(batches)])
        for n, reqs in batches:
            engine.run_prefill(reqs, n, outputs)
        for _ in range(num_prefill - len(batches)):
            self._empty_forward()
        engine.finish(outputs)
        reqs = engine.decode_batch()
        (any_decode,) = self._agree_max([int(bool(reqs))])
        if reqs:
            engine.run_decode(reqs, outputs)
        elif any_decode:
            self._empty_forward()
        engine.finish(outputs)
        return list(outputs.values())

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 prefixes: Sequence[Completion | None] | None = None) -> list[Completion]:
        """Run this rank's prompts (maybe none) to completion while the other ranks run theirs (collective).
        A request that is refused comes back with finish_reason "error", as from Engine.generate."""
        return run_to_completion(self.submit, self.step, self.any_unfinished, prompts, params, prefixes)

    def _agree_max(self, values: list[int]) -> list[int]:
        """Element-wise max of `values` over the ranks: one all_reduce of a few integers."""
        t = torch.tensor(values, dtype=torch.int64, device=self._agree_device)
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    @torch.no_grad()
    def _empty_forward(self) -> None:
        """Take part in every MoE layer's dispatch/combine with no tokens of our own (see the module docstring)."""
        model = self.engine.model
        x_0D = torch.zeros(0, model.config.hidden_size, dtype=self.engine.dtype, device=self.engine.device)
        for block in model.moe_blocks:
            block(x_0D)
        self.stats["empty_forwards"] += 1
