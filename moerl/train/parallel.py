"""Data-parallel sharding of the policy with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Units: each decoder layer, then the root (embeddings, final norm, lm_head), as in torchtitan. Expert
weights split by expert parallelism are left out (`ignored_params`): they are already disjoint across the
EP ranks, and the dispatcher's combine-backward brings every rank's gradient for an expert to its owner.
Without EP the experts are replicated parameters like any other and FSDP shards them too.

Gradients are SUMMED across ranks, not averaged: the trainer normalises its loss by the global token count,
so the sum is the gradient of the whole batch and N ranks step exactly like one rank. Sum-only
collectives (`force_sum_reduction_for_comms`) also keep gloo working: it has no AVG or PREMUL_SUM.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from moerl.model.transformer import MoECausalLM


def expert_params(model: MoECausalLM) -> set[torch.nn.Parameter]:
    """The expert weights of MoE blocks whose dispatcher splits the experts over more than one rank."""
    return {p for block in model.moe_blocks if block.dispatcher.world_size > 1 for p in block.experts.parameters()}


def shard_model(model: MoECausalLM, group: dist.ProcessGroup) -> DeviceMesh:
    """Shard `model` in place over the ranks of `group` (call on every rank, before building the optimizer).

    The mesh gets its own process group so FSDP's all-gathers and reduce-scatters never share a communicator
    with the EP all-to-alls or the trainer's own reductions."""
    device = next(model.parameters()).device
    fsdp_group = dist.new_group(ranks=dist.get_process_group_ranks(group), backend=dist.get_backend(group))
    mesh = DeviceMesh.from_group(fsdp_group, device.type)
    ignored = expert_params(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored & set(layer.parameters()) or None)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    register_fsdp_forward_method(model, "forward_full")  # the trainer calls forward_full, not forward
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return mesh


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for an FSDP shard: every rank of the mesh must call it, in order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local shard of a DTensor, else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t
