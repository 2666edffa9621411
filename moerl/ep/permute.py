"""Token permutation by expert, shared by every dispatcher backend.

Shape legend: T tokens, K slots per token, M = T*K (token, slot) pairs, E experts, D hidden size.
"""

from __future__ import annotations

import torch

from moerl.kernels import use_triton


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


def inverse_permutation(order_N: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """inverse_M[m] = row of pair m among the N kept rows, or N (a zero row) for dropped pairs."""
    N = order_N.numel()
    inverse_M = torch.full((num_pairs,), N, dtype=torch.long, device=order_N.device)
    inverse_M[order_N] = torch.arange(N, device=order_N.device)
    return inverse_M


def _with_zero_row(x_ND: torch.Tensor) -> torch.Tensor:
    return torch.cat([x_ND, x_ND.new_zeros(1, x_ND.shape[1])])


# Both permutations below are gathers in forward AND backward. Autograd's own backward of indexing is a
# scatter-add: atomic on CUDA (float sums depend on thread timing) and slow (2.4 ms of a 14 ms MoE step on
# an H200 at Qwen3-30B-A3B shapes). Gathering by the inverse permutation instead is deterministic on every
# device and bandwidth-bound.


class _ExpandTokens(torch.autograd.Function):
    """x_ND[n] = x_TD[order_N[n] // K]: copy each token once per kept slot, in expert order."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, order_N: torch.Tensor, K: int) -> torch.Tensor:
        ctx.save_for_backward(order_N)
        ctx.T, ctx.K = x_TD.shape[0], K
        return x_TD.index_select(0, order_N // K)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        (order_N,) = ctx.saved_tensors
        T, K, D = ctx.T, ctx.K, grad_ND.shape[1]
        inverse_M = inverse_permutation(order_N, T * K)
        if use_triton(grad_ND):
            from moerl.kernels.triton_moe import gather_weighted_sum

            inverse_TK = torch.where(inverse_M < order_N.numel(), inverse_M, -1).view(T, K)
            return gather_weighted_sum(grad_ND, inverse_TK, None), None, None
        if order_N.numel() < T * K:
            grad_ND = _with_zero_row(grad_ND)
        # Sum the K slots of each token in a fixed order (float32 accumulation inside sum).
        return grad_ND.index_select(0, inverse_M).view(T, K, D).sum(1), None, None


def expand_tokens(x_TD: torch.Tensor, order_N: torch.Tensor, K: int) -> torch.Tensor:
    """Differentiable, deterministic copy of token rows into (token, slot) rows sorted by expert."""
    return _ExpandTokens.apply(x_TD, order_N, K)


class _CombineWeighted(torch.autograd.Function):
    """out_TD[t] = sum_k w_TK[t, k] * y_ND[row of (t, k)]; dropped pairs contribute zero."""

    @staticmethod
    def forward(ctx, y_ND: torch.Tensor, order_N: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        T, K = w_TK.shape
        inverse_M = inverse_permutation(order_N, T * K)
        ctx.save_for_backward(y_ND, order_N, inverse_M, w_TK)
        if use_triton(y_ND):
            from moerl.kernels.triton_moe import gather_weighted_sum

            inverse_TK = torch.where(inverse_M < order_N.numel(), inverse_M, -1).view(T, K)
            return gather_weighted_sum(y_ND, inverse_TK, w_TK)
        y_TKD = _gather_pairs(y_ND, inverse_M, T, K)
        # Weight in the activation dtype, then reduce: the same rounding as transformers' experts.
        return (y_TKD * w_TK.to(y_ND.dtype).unsqueeze(-1)).sum(1)

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        y_ND, order_N, inverse_M, w_TK = ctx.saved_tensors
        T, K = w_TK.shape
        grad_TD = grad_TD.contiguous()
        if use_triton(y_ND):
            from moerl.kernels.triton_moe import combine_backward

            grad_y_ND, grad_w_TK = combine_backward(grad_TD, y_ND, order_N, w_TK, ctx.needs_input_grad[2])
            return grad_y_ND, None, grad_w_TK
        grad_y_MD = (grad_TD.unsqueeze(1) * w_TK.to(grad_TD.dtype).unsqueeze(-1)).view(T * K, grad_TD.shape[1])
        grad_y_ND = grad_y_MD.index_select(0, order_N)
        grad_w_TK = None
        if ctx.needs_input_grad[2]:
            y_TKD = _gather_pairs(y_ND, inverse_M, T, K)
            acc = torch.promote_types(y_ND.dtype, torch.float32)  # at least float32; float64 stays float64
            grad_w_TK = (y_TKD.to(acc) * grad_TD.to(acc).unsqueeze(1)).sum(-1).to(w_TK.dtype)
        return grad_y_ND, None, grad_w_TK


def _gather_pairs(y_ND: torch.Tensor, inverse_M: torch.Tensor, T: int, K: int) -> torch.Tensor:
    if inverse_M.numel() > y_ND.shape[0]:
        y_ND = _with_zero_row(y_ND)
    return y_ND.index_select(0, inverse_M).view(T, K, y_ND.shape[1])


def combine_weighted(y_ND: torch.Tensor, order_N: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """Un-permute expert outputs to token order and mix the K slots with the router weights."""
    return _CombineWeighted.apply(y_ND, order_N, w_TK)


def gather_rows(x_SD: torch.Tensor, index_N: torch.Tensor) -> torch.Tensor:
    """Row gather for permutations (unique indices: its scatter backward has no collisions)."""
    return x_SD.index_select(0, index_N)
