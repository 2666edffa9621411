"""Expert-parallel dispatch/combine. Backends: local (no EP), all_to_all (torch.distributed), symm_mem (NVSHMEM)."""

from __future__ import annotations

from typing import Literal

import torch.distributed as dist

from moerl.ep.dispatcher import BackendUnavailable, Dispatcher, LocalDispatcher

BackendName = Literal["auto", "local", "all_to_all", "symm_mem"]
BACKENDS = ("auto", "local", "all_to_all", "symm_mem")


def auto_backend(world_size: int) -> str:
    """What `auto` means: `local` for one rank, else `all_to_all`, never `symm_mem`. symm_mem has not yet run on
    two GPUs (NVSHMEM refuses a 1-rank group, and only one GPU has been lent), so a run gets it only by naming it;
    all_to_all is the backend the multi-rank tests (gloo) check, and NCCL runs the same code."""
    return "local" if world_size == 1 else "all_to_all"


def make_dispatcher(
    name: str, num_experts: int, group: dist.ProcessGroup | None = None
) -> Dispatcher:
    """Build the dispatcher `name` for `num_experts` experts spread over `group` (None: no EP)."""
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown dispatcher {name!r}; choose one of {', '.join(BACKENDS)}")
    world_size = dist.get_world_size(group) if group is not None else 1
    if num_experts % world_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel size {world_size}: "
            "every rank must hold the same number of experts"
        )
    if name == "auto":
        name = auto_backend(world_size)
    if name == "local":
        if world_size > 1:
            raise BackendUnavailable(
                f"dispatcher 'local' holds every expert on one rank, but the expert-parallel group has {world_size} ranks"
            )
        return LocalDispatcher(num_experts)
    if group is None:
        raise BackendUnavailable(f"dispatcher {name!r} needs an expert_parallel_group (torch.distributed)")
    if name == "all_to_all":
        from moerl.ep.all_to_all import AllToAllDispatcher

        return AllToAllDispatcher(num_experts, group)
    from moerl.ep.symm_mem import SymmMemDispatcher, symm_mem_unavailable_reason

    reason = symm_mem_unavailable_reason(group, num_experts)
    if reason is not None:
        raise BackendUnavailable(f"dispatcher 'symm_mem' cannot run here: {reason}; use 'all_to_all' instead")
    return SymmMemDispatcher(num_experts, group)


__all__ = ["BACKENDS", "BackendUnavailable", "Dispatcher", "LocalDispatcher", "auto_backend", "make_dispatcher"]
