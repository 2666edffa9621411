"""Token permutation by expert, shared by every dispatcher backend.

Shape legend: T tokens, K slots per token, M = T*K (token, slot) pairs, E experts, D hidden size.
"""

from __future__ import annotations

import torch


def count_per_expert(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 count of each expert id in [0, num_experts); ids outside (dropped, -1) are not counted.

    A scatter-add into a fixed-size buffer: unlike bincount it never reads the max back to the host.
    """
    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=idx.device)
    counts.scatter_add_(0, torch.where(valid, flat, num_experts), torch.ones_like(flat, dtype=torch.long))
    return counts[:num_experts]


def sort_by_expert(
    topk_idx_TK: torch.Tensor, num_experts: int, may_drop: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Order the (token, slot) pairs by expert id; dropped pairs (-1) go last.

    Returns (order_M: pair index of each sorted row, counts_E: int64 rows per expert, num_kept).
    A stable sort keeps tokens of one expert in their original order, which makes the result
    independent of the sort kernel and equal across backends.
    """
    flat_M = topk_idx_TK.reshape(-1)
    keys_M = torch.where(flat_M < 0, num_experts, flat_M) if may_drop else flat_M
    order_M = torch.sort(keys_M, stable=True).indices
    counts_E = count_per_expert(flat_M, num_experts)
    num_kept = int(counts_E.sum()) if may_drop else flat_M.numel()
    return order_M, counts_E, num_kept


class _ExpandTokens(torch.autograd.Function):
    """x_ND[n] = x_TD[order_M[n] // K]: copy each token once per (kept) slot, in expert order.

    Autograd's own backward for indexing is an atomic scatter-add on CUDA, whose float sums depend on
    thread timing. Here the backward writes each row's gradient to its own (token, slot) place (no
    collisions) and sums over the K slots in a fixed order: deterministic on every device.
    """

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, order_N: torch.Tensor, K: int) -> torch.Tensor:
        ctx.save_for_backward(order_N)
        ctx.T, ctx.K = x_TD.shape[0], K
        return x_TD.index_select(0, order_N // K)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        (order_N,) = ctx.saved_tensors
        grad_MD = grad_ND.new_zeros(ctx.T * ctx.K, grad_ND.shape[1])
        grad_MD.index_copy_(0, order_N, grad_ND)
        return grad_MD.view(ctx.T, ctx.K, -1).sum(1), None, None


def expand_tokens(x_TD: torch.Tensor, order_N: torch.Tensor, K: int) -> torch.Tensor:
    """Differentiable, deterministic copy of token rows into (token, slot) rows sorted by expert."""
    return _ExpandTokens.apply(x_TD, order_N, K)


def gather_rows(x_SD: torch.Tensor, index_N: torch.Tensor) -> torch.Tensor:
    """Row gather for permutations (unique indices: its scatter backward has no collisions)."""
    return x_SD.index_select(0, index_N)
