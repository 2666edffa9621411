"""The router's softmax + top-k (Qwen3-MoE, with the aux-loss-free expert bias): the torch reference, which is
moerl.model.moe.TopKRouter's own computation without routing replay, and the dispatch to the sort-free Triton
kernel (moerl/kernels/triton_router.py) on the no-grad CUDA path.

Shape legend: T tokens, E experts, K experts per token.

The kernel runs only where no autograd graph is recorded (the rollout engine's forwards) on CUDA with triton and
at most MAX_EXPERTS experts; training and CPU runs take the reference (gradients reach the router through the
chosen probabilities). Ties: the kernel picks the lowest expert index first; torch.topk's order among exactly
equal scores is unspecified. Neither path syncs with the host (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from moerl.kernels import use_triton


def router_topk_reference(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool,
                          expert_bias_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx_TK int64, topk_weights_TK in the logits' dtype): softmax over E in float32; the top-k by the
    probabilities (+ expert_bias_E, which chooses but never weighs), descending; renormalised on request."""
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    if expert_bias_E is not None:
        topk_idx_TK = torch.topk(probs_TE + expert_bias_E, top_k, dim=-1).indices
        topk_probs_TK = probs_TE.gather(1, topk_idx_TK)
    else:
        topk_probs_TK, topk_idx_TK = torch.topk(probs_TE, top_k, dim=-1)
    if norm_topk_prob:
        topk_probs_TK = topk_probs_TK / topk_probs_TK.sum(dim=-1, keepdim=True)
    return topk_idx_TK, topk_probs_TK.to(logits_TE.dtype)


def fused_router_applies(logits_TE: torch.Tensor, top_k: int) -> bool:
    """Whether the Triton kernel takes this call: no autograd graph to record, CUDA + triton, E in registers."""
    if torch.is_grad_enabled() or not use_triton(logits_TE) or logits_TE.dim() != 2:
        return False
    from moerl.kernels.triton_router import MAX_EXPERTS

    return 0 < top_k <= logits_TE.shape[1] <= MAX_EXPERTS


def router_topk(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool,
                expert_bias_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_topk_reference`, on the no-grad CUDA path by one sort-free kernel (lowest index first on ties)."""
    if fused_router_applies(logits_TE, top_k):
        from moerl.kernels.triton_router import router_topk_triton

        return router_topk_triton(logits_TE, top_k, norm_topk_prob, expert_bias_E)
    return router_topk_reference(logits_TE, top_k, norm_topk_prob, expert_bias_E)
