"""The sparse MoE block: a top-k router, grouped experts, and a dispatcher between them.

Shape legend: T tokens, K experts per token, E experts in all, L experts on this rank,
N rows for the local experts (grouped by expert), D hidden size, I expert intermediate size.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moerl.ep.dispatcher import Dispatcher, LocalDispatcher
from moerl.ep.permute import count_per_expert
from moerl.kernels import swiglu
from moerl.kernels.fused_moe import fused_moe, fused_moe_self_check, fused_moe_unavailable
from moerl.kernels.router import router_topk
from moerl.model.config import MoEModelConfig

# "fused": the Triton decode path (moerl/kernels/fused_moe.py), forward only; "auto" takes it at decode sizes.
ExpertsImpl = Literal["auto", "grouped_mm", "loop", "fused"]

# Up to this many tokens `auto` runs the fused path under no_grad: decode batches and prefill chunks up to it.
# Measured on one H200 (`moerl bench moe-decode`, one block in a CUDA graph, fused vs our grouped GEMM): the 30B-A3B
# shape (128 experts, top-8) 1.44x at 1024 tokens, 1.31x at 2048, 0.88x at 4096 and 0.67x at 8192; the 0.92B
# preset's 1.74x at 2048 and 1.14x at 4096. Past ~2-3k tokens the layer turns compute-bound, where CUTLASS's
# grouped GEMM tiles win. 2048 is the largest size measured to win on both shapes.
FUSED_MAX_TOKENS = 2048


def is_expert_param(name: str) -> bool:
    """A routed expert's weight (`...mlp.experts.gate_up_proj` / `down_proj`): split over ranks under EP."""
    return ".experts." in name


@dataclass
class RouterOutput:
    topk_idx_TK: torch.Tensor  # int64 expert ids (-1 where dropped by capacity)
    topk_weights_TK: torch.Tensor  # in the activation dtype, like HF
    aux_loss: torch.Tensor | None  # Switch-style load-balancing loss, when asked for
    counts_E: torch.Tensor  # int64 tokens routed to each expert on this rank (for balancing and plots)


class TopKRouter(nn.Module):
    """Softmax top-k router (Qwen3-MoE), with routing replay and the aux-loss-free expert bias.

    The expert bias (DeepSeek-V3) shifts which experts are chosen, never the mixing weights; it is a
    persistent buffer so trainer checkpoints keep it, and it is not part of the HF weight format.
    """

    def __init__(self, config: MoEModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # A Python flag, not a test of the buffer, so the forward never waits on the device.
        self.bias_enabled = False

    def forward(
        self, x_TD: torch.Tensor, replay_idx_TK: torch.Tensor | None = None, with_aux_loss: bool = False
    ) -> RouterOutput:
        logits_TE = F.linear(x_TD, self.weight)
        if replay_idx_TK is None and not with_aux_loss:  # one sort-free kernel on the no-grad CUDA path
            bias_E = self.expert_bias if self.bias_enabled else None
            topk_idx_TK, topk_weights_TK = router_topk(logits_TE, self.top_k, self.norm_topk_prob, bias_E)
            return RouterOutput(topk_idx_TK, topk_weights_TK, None, count_per_expert(topk_idx_TK, self.num_experts))
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        if replay_idx_TK is not None:
            # Routing replay: recompute on the experts the rollout chose; gradients reach the router
            # through the probabilities of those experts.
            self._check_replay(replay_idx_TK, x_TD.shape[0])
            topk_idx_TK = replay_idx_TK.to(device=x_TD.device, dtype=torch.long)
            topk_probs_TK = probs_TE.gather(1, topk_idx_TK)
        elif self.bias_enabled:
            topk_idx_TK = torch.topk(probs_TE + self.expert_bias, self.top_k, dim=-1).indices
            topk_probs_TK = probs_TE.gather(1, topk_idx_TK)
        else:
            topk_probs_TK, topk_idx_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_probs_TK = topk_probs_TK / topk_probs_TK.sum(dim=-1, keepdim=True)
        counts_E = count_per_expert(topk_idx_TK, self.num_experts)
        aux_loss = None
        if with_aux_loss:
            tokens_fraction_E = counts_E.float() / max(1, topk_idx_TK.numel())
            aux_loss = self.num_experts * torch.sum(tokens_fraction_E * probs_TE.mean(0))
        return RouterOutput(topk_idx_TK, topk_probs_TK.to(logits_TE.dtype), aux_loss, counts_E)

    def _check_replay(self, replay_idx_TK: torch.Tensor, num_tokens: int) -> None:
        if replay_idx_TK.shape != (num_tokens, self.top_k):
            raise ValueError(
                f"routing replay expects expert indices of shape [tokens={num_tokens}, top_k={self.top_k}], "
                f"got {tuple(replay_idx_TK.shape)}"
            )

    @torch.no_grad()
    def update_expert_bias(self, counts_E: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded."""
        self.bias_enabled = True
        load_E = counts_E.float().to(self.expert_bias.device)
        self.expert_bias += rate * torch.sign(load_E.mean() - load_E)


def apply_capacity(topk_idx_TK: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """Drop (mark -1) the pairs past each expert's capacity, earliest tokens first."""
    T, K = topk_idx_TK.shape
    capacity = math.ceil(capacity_factor * T * K / num_experts)
    flat_M = topk_idx_TK.reshape(-1)
    order_M = torch.sort(flat_M, stable=True).indices
    counts_E = count_per_expert(flat_M, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert_M = torch.empty_like(flat_M)
    rank_in_expert_M[order_M] = torch.arange(flat_M.numel(), device=flat_M.device) - starts_E[flat_M[order_M]]
    return torch.where(rank_in_expert_M < capacity, flat_M, -1).view(T, K)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """torch._grouped_mm covers fp32/bf16/fp16 on CPU and bf16 on Hopper-or-newer GPUs."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


class GroupedExperts(nn.Module):
    """SwiGLU experts stored stacked, in transformers' fused layout: gate_up_proj [L, 2I, D], down_proj [L, D, I]."""

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, impl: ExpertsImpl = "auto"):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.impl = impl
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, hidden_size, intermediate_size))

    def forward(self, x_ND: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        # "fused" is a whole-block path (SparseMoEBlock routes around this call); called alone it acts as auto.
        use_grouped = self.impl == "grouped_mm" or (
            self.impl in ("auto", "fused") and grouped_mm_available(x_ND) and self._grouped_mm_aligned(x_ND)
        )
        if use_grouped:
            offs_L = torch.cumsum(counts_L, 0, dtype=torch.int32)
            h_NF = torch._grouped_mm(x_ND, self.gate_up_proj.transpose(-2, -1), offs=offs_L)
            return torch._grouped_mm(swiglu(h_NF), self.down_proj.transpose(-2, -1), offs=offs_L)
        return self._loop(x_ND, counts_L)

    def _grouped_mm_aligned(self, x_ND: torch.Tensor) -> bool:
        """torch._grouped_mm needs 16-byte row strides: hidden and intermediate sizes of whole 16-byte blocks."""
        row_bytes = x_ND.element_size()
        return (x_ND.shape[-1] * row_bytes) % 16 == 0 and (self.intermediate_size * row_bytes) % 16 == 0

    def _loop(self, x_ND: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        """Per-expert matmuls: any dtype and device (float64 references); one host sync for the splits."""
        sizes = counts_L.tolist()
        outs = []
        for e, x_nD in enumerate(torch.split(x_ND[: sum(sizes)], sizes)):
            gate_nI, up_nI = (x_nD @ self.gate_up_proj[e].T).chunk(2, dim=-1)
            outs.append((F.silu(gate_nI) * up_nI) @ self.down_proj[e].T)
        rows = sum(o.shape[0] for o in outs)
        if rows < x_ND.shape[0]:  # padding rows past the counts (never read by combine)
            outs.append(x_ND.new_zeros(x_ND.shape[0] - rows, x_ND.shape[1]))
        return torch.cat(outs) if outs else x_ND.new_zeros(0, x_ND.shape[1])


@dataclass
class MoEOutput:
    out_TD: torch.Tensor
    topk_idx_TK: torch.Tensor
    aux_loss: torch.Tensor | None
    counts_E: torch.Tensor


class SparseMoEBlock(nn.Module):
    """Router -> dispatch -> grouped experts -> combine. EP is a dispatcher choice, not a branch here."""

    def __init__(
        self,
        config: MoEModelConfig,
        dispatcher: Dispatcher | None = None,
        capacity_factor: float = 0.0,
        experts_impl: ExpertsImpl = "auto",
    ) -> None:
        super().__init__()
        self.dispatcher = dispatcher or LocalDispatcher(config.num_experts)
        if self.dispatcher.num_experts != config.num_experts:
            raise ValueError(
                f"dispatcher serves {self.dispatcher.num_experts} experts, the model has {config.num_experts}"
            )
        self.capacity_factor = capacity_factor
        self.dispatcher.may_drop = self.dispatcher.may_drop or capacity_factor > 0
        self.gate = TopKRouter(config)
        self.experts = GroupedExperts(
            self.dispatcher.num_local_experts, config.hidden_size, config.moe_intermediate_size, experts_impl
        )

    def forward(
        self, x_TD: torch.Tensor, replay_idx_TK: torch.Tensor | None = None, with_aux_loss: bool = False
    ) -> MoEOutput:
        routed = self.gate(x_TD, replay_idx_TK, with_aux_loss)
        topk_idx_TK = routed.topk_idx_TK
        if self.capacity_factor > 0:
            topk_idx_TK = apply_capacity(topk_idx_TK, self.gate.num_experts, self.capacity_factor)
        if self._use_fused(x_TD):  # no dispatch/combine copies: the kernels gather token rows themselves
            out_TD = fused_moe(x_TD, topk_idx_TK, routed.topk_weights_TK, self.experts.gate_up_proj,
                               self.experts.down_proj)
            return MoEOutput(out_TD, routed.topk_idx_TK, routed.aux_loss, routed.counts_E)
        x_ND, counts_L, handle = self.dispatcher.dispatch(x_TD, topk_idx_TK, routed.topk_weights_TK)
        y_ND = self.experts(x_ND, counts_L)
        out_TD = self.dispatcher.combine(y_ND, handle)
        return MoEOutput(out_TD, routed.topk_idx_TK, routed.aux_loss, routed.counts_E)

    def _use_fused(self, x_TD: torch.Tensor) -> bool:
        """Forced ("fused"): always, or a ValueError saying why not. Auto: without autograd, bf16/fp16 on CUDA,
        at most FUSED_MAX_TOKENS tokens, wherever the path can run."""
        impl = self.experts.impl
        if impl == "fused":
            reason = self._fused_refusal(x_TD)
            if reason is not None:
                raise ValueError(f"experts_impl='fused' cannot run here: {reason}")
            return True
        return (impl == "auto" and not torch.is_grad_enabled() and x_TD.dtype in (torch.bfloat16, torch.float16)
                and x_TD.shape[0] <= FUSED_MAX_TOKENS and self._fused_refusal(x_TD) is None and self._fused_checked())

    def _fused_checked(self) -> bool:
        """Auto's last condition: the kernels passed their self-check at this block's shape (once per process and
        shape; the engine's first forwards are eager, so it never runs inside a graph capture)."""
        experts = self.experts
        verdict = _fused_verdict(experts.gate_up_proj.device, experts.gate_up_proj.dtype, *experts.down_proj.shape,
                                 self.gate.top_k)
        if verdict.reason is None and not verdict.done:
            verdict.reason = fused_moe_self_check(experts.gate_up_proj, experts.down_proj, self.gate.top_k)
            verdict.done = True
            if verdict.reason is not None:
                logging.getLogger(__name__).warning("the fused MoE decode path is off at %s: %s; decode runs the "
                                                    "grouped GEMM path", tuple(experts.down_proj.shape), verdict.reason)
        return verdict.reason is None

    def _fused_refusal(self, x_TD: torch.Tensor) -> str | None:
        reason = fused_moe_unavailable(x_TD)
        if reason is not None:
            return reason
        if not isinstance(self.dispatcher, LocalDispatcher) or self.dispatcher.world_size != 1:
            return f"it holds every expert on one rank, the dispatcher is {type(self.dispatcher).__name__}"
        if self.capacity_factor > 0 or self.dispatcher.may_drop:
            return "it routes every pair, capacity drops are on"
        if self.experts.gate_up_proj.dtype != x_TD.dtype or self.experts.down_proj.dtype != x_TD.dtype:
            return f"expert weights are {self.experts.gate_up_proj.dtype}, activations {x_TD.dtype}"
        if torch.is_grad_enabled() and (x_TD.requires_grad or any(p.requires_grad for p in self.parameters())):
            return "it has no backward, run it under torch.no_grad()"
        return None


@dataclass
class _FusedVerdict:
    done: bool = False
    reason: str | None = None  # why the fused path failed its self-check


@functools.lru_cache(maxsize=None)
def _fused_verdict(device: torch.device, dtype: torch.dtype, E: int, D: int, I: int, K: int) -> _FusedVerdict:
    """One self-check verdict per process and shape, shared by every block of that shape (a model's 48 layers
    check once, on the first block's weights)."""
    return _FusedVerdict()
