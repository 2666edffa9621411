"""The trainer's parallel layout: process groups, FSDP2 sharding with mixed precision, and the compute cast.

Layout of W ranks with expert-parallel size P (P divides W), as a 2D mesh ("efsdp", "ep") of W/P x P:

    ep     ranks that split the experts: rank e of each EP group holds experts [e E/P, (e+1) E/P)
    efsdp  the W/P ranks holding the same expert slice (one per EP group): FSDP shards that slice over them
    dense  every other parameter: FSDP over all W ranks (one unit per decoder layer plus the root, as torchtitan)

Gradients are SUMMED, not averaged: the trainer normalises its loss by the global token count, so the sum is
the gradient of the whole batch and W ranks step exactly like one rank. The EP combine-backward already sums an
expert's gradient over its EP group; the efsdp reduce-scatter sums it over the groups. Sum-only collectives
(`force_sum_reduction_for_comms`) also keep gloo working: it has no AVG or PREMUL_SUM.

Mixed precision: parameters (the master copy) and optimizer state stay in `master` dtype (float32); forward and
backward compute in `compute` dtype (bfloat16). Sharded: FSDP2's MixedPrecisionPolicy (gathered parameters cast
to `compute`, gradients reduced in float32). Not sharded (one rank, or `replicate`): `compute_cast` runs the
model on cast copies of its parameters; autograd brings the gradients back to the float32 parameters.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from moerl.model.transformer import MoECausalLM

FORWARD_METHODS = ("forward_full", "forward_logprobs")  # what the trainer calls instead of forward()


@dataclass
class TrainerGroups:
    """The trainer's process groups (every rank builds the same, in the same order)."""

    world: dist.ProcessGroup | None  # all trainer ranks; None = one process, no torch.distributed
    ep: dist.ProcessGroup | None  # this rank's EP group; None = every rank holds every expert
    ep_size: int
    efsdp_mesh: DeviceMesh | None  # the ranks holding this rank's expert slice (None without EP)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.world) if self.world is not None else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.world) if self.world is not None else 0

    @property
    def efsdp_rank(self) -> int:
        """This rank's index among the replicas of its expert slice (0 for the first EP group)."""
        return self.efsdp_mesh.get_local_rank() if self.efsdp_mesh is not None else 0


def trainer_groups(ep_size: int, device_type: str) -> TrainerGroups:
    """Groups over the default process group (or none when torch.distributed is not initialised)."""
    if not dist.is_initialized():
        if ep_size != 1:
            raise ValueError(f"ep_size={ep_size} needs an initialised torch.distributed group")
        return TrainerGroups(None, None, 1, None)
    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the number of trainer ranks ({world})")
    if ep_size == 1:
        return TrainerGroups(dist.group.WORLD, None, 1, None)
    mesh = init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("efsdp", "ep"))
    return TrainerGroups(dist.group.WORLD, mesh["ep"].get_group(), ep_size, mesh["efsdp"])


def expert_params(model: MoECausalLM) -> set[nn.Parameter]:
    """The expert weights of MoE blocks whose dispatcher splits the experts over more than one rank."""
    return {p for block in model.moe_blocks if block.dispatcher.world_size > 1 for p in block.experts.parameters()}


def shard_model(model: MoECausalLM, groups: TrainerGroups, compute_dtype: torch.dtype | None = None) -> None:
    """Shard `model` in place (call on every rank, before building the optimizer).

    The dense mesh gets its own process group so FSDP's all-gathers and reduce-scatters never share a
    communicator with the EP all-to-alls or the trainer's own reductions."""
    device = next(model.parameters()).device
    ranks = dist.get_process_group_ranks(groups.world)
    dense = DeviceMesh.from_group(dist.new_group(ranks=ranks, backend=dist.get_backend(groups.world)), device.type)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for layer in model.model.layers:
        if groups.efsdp_mesh is not None and layer.is_moe:
            # its own unit over the replicas of this slice; the layer's unit below then skips these params
            fully_shard(layer.mlp.experts, mesh=groups.efsdp_mesh, **kwargs)
        fully_shard(layer, mesh=dense, **kwargs)
    fully_shard(model, mesh=dense, **kwargs)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(model, name)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def compute_cast(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Inside: the model's floating-point parameters are cast copies in `dtype` (differentiable: gradients reach
    the master parameters in their own dtype). Run forward AND backward inside, since activation checkpointing
    recomputes layers during backward and must see the same weights. dtype None, or the parameters' own: nothing.

    Each parameter is swapped for its cast as a plain attribute and put back on exit; a parameter shared by
    two modules (tied embeddings) is cast once."""
    slots = [(module, name, p) for module in model.modules() for name, p in module._parameters.items()
             if p is not None and p.is_floating_point()]
    if dtype is None or all(p.dtype == dtype for _, _, p in slots):
        yield
        return
    casts: dict[int, torch.Tensor] = {}
    for module, name, p in slots:
        cast = casts.setdefault(id(p), p.to(dtype))
        del module._parameters[name]
        setattr(module, name, cast)
    try:
        yield
    finally:
        for module, name, p in slots:
            delattr(module, name)
            module._parameters[name] = p


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for an FSDP shard: every rank of the mesh must call it, in order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local shard of a DTensor, else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t
