"""Build a policy model from an architecture: random init (demo, tests) with optional expert parallelism."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moerl.ep import make_dispatcher
from moerl.model.config import MoEModelConfig
from moerl.model.layers import RMSNorm
from moerl.model.moe import ExpertsImpl, GroupedExperts, TopKRouter
from moerl.model.transformer import MoECausalLM


def build_model(
    config: MoEModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    expert_parallel_group: dist.ProcessGroup | None = None,
    dispatcher: str = "auto",
    capacity_factor: float = 0.0,
    experts_impl: ExpertsImpl = "auto",
    seed: int | None = 0,
    init: bool = True,
) -> MoECausalLM:
    """A model with HF-style random weights (normal(0, initializer_range), norms at one).

    With `seed` set, every rank of an expert-parallel group draws the same full expert tensors and
    keeps its own slice, so an EP model equals the single-process model built with the same seed.
    """
    disp = make_dispatcher(dispatcher, config.num_experts, expert_parallel_group)
    with torch.device("meta"):
        model = MoECausalLM(config, dispatcher=disp, capacity_factor=capacity_factor, experts_impl=experts_impl)
    model = model.to(dtype).to_empty(device=device)  # cast on meta: the device holds only `dtype` copies
    model.tie_weights()  # to_empty breaks the sharing of tied parameters
    model.model.rotary.__init__(config.head_dim, config.rope_theta)  # non-persistent buffer lost on meta
    model.model.rotary.to(device)
    for block in model.moe_blocks:
        # .to(dtype) cast the expert bias too; keep it float32 (bf16 would swallow small update steps).
        block.gate.expert_bias = torch.zeros(config.num_experts, dtype=torch.float32, device=device)
    if init:
        init_weights(model, seed)
    return model


@torch.no_grad()
def init_weights(model: MoECausalLM, seed: int | None = 0) -> None:
    std = model.config.initializer_range
    gen = torch.Generator(device="cpu")
    if seed is not None:
        gen.manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding, TopKRouter)):
            _fill_normal(module.weight, std, gen)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, GroupedExperts):
            block = model.get_submodule(name.rsplit(".", 1)[0])
            local = block.dispatcher.local_expert_slice
            for param in (module.gate_up_proj, module.down_proj):
                full_shape = (block.dispatcher.num_experts, *param.shape[1:])
                full = torch.empty(full_shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                param.copy_(full[local])
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)


def _fill_normal(param: torch.Tensor, std: float, gen: torch.Generator) -> None:
    param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))
