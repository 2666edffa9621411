"""Expert parallelism over torch.distributed: two uneven all_to_all_single calls per direction.

Shape legend: T tokens on this rank, K experts per token, D hidden size, E experts in all,
P ranks in the group, L = E/P experts per rank, S rows this rank sends (its kept (token, slot) pairs,
sorted by global expert, hence by destination rank then local expert), N rows it receives for its
own experts, M = T*K (token, slot) pairs.

    dispatch: sort pairs by expert -> exchange counts_E (one all_to_all) -> one host sync of the
              splits -> all_to_all the rows -> reorder [source rank][local expert] to [local expert][source rank]
    combine:  undo the reorder -> all_to_all back (splits swapped) -> weighted sum over slots, here on the
              source rank, so the router weights and their gradient never leave it.

Works on gloo (CPU) and NCCL (GPU); zero-row sends/receives and T=0 are fine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moerl.ep.dispatcher import Dispatcher, weighted_sum_over_slots
from moerl.ep.permute import expand_tokens, gather_rows, sort_by_expert


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all of rows; its backward is the same exchange with the splits swapped.

    Written out (not torch's functional collectives) so the backward is one plain collective that every
    backend supports, and so the splits stay host lists computed once in dispatch.
    """

    @staticmethod
    def forward(ctx, x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x_SD, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad_ND, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    # gloo rejects non-contiguous tensors, and autograd may hand us an expanded (stride-0) gradient.
    x_SD = x_SD.contiguous()
    out_ND = x_SD.new_empty(sum(out_splits), *x_SD.shape[1:])
    dist.all_to_all_single(out_ND, x_SD, out_splits, in_splits, group=group)
    return out_ND


def all_to_all_rows(x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all_to_all: send in_splits[p] rows to rank p, receive out_splits[p] from it."""
    return _AllToAll.apply(x_SD, out_splits, in_splits, group)


@dataclass(frozen=True)
class AllToAllHandle:
    order_M: torch.Tensor  # (token, slot) pair index of each sorted row, kept rows first
    num_kept: int  # S
    topk_weights_TK: torch.Tensor
    send_splits_P: tuple[int, ...]  # rows sent to each rank (= received back from it in combine)
    recv_splits_P: tuple[int, ...]  # rows received from each rank
    unsort_N: torch.Tensor  # y_ND[unsort_N] puts expert-grouped results back in received order


class AllToAllDispatcher(Dispatcher):
    """Rank r holds experts [r*L, (r+1)*L); tokens travel to them and back with all_to_all_single."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None) -> None:
        group = group if group is not None else dist.group.WORLD
        super().__init__(num_experts, dist.get_rank(group), dist.get_world_size(group))
        self.group = group

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK):
        P, L, K = self.world_size, self.num_local_experts, topk_idx_TK.shape[1]
        order_M, counts_E, num_kept = sort_by_expert(topk_idx_TK, self.num_experts, self.may_drop)
        x_SD = expand_tokens(x_TD, order_M[:num_kept], K)
        # counts_E viewed [P, L]: chunk p goes to rank p, so we get, per source rank, counts per our experts.
        counts_PL = torch.empty_like(counts_E)
        dist.all_to_all_single(counts_PL, counts_E, group=self.group)
        counts_PL = counts_PL.view(P, L)
        # The one host sync of the exchange: all_to_all_single needs its splits as Python ints.
        host = torch.cat([counts_E.view(P, L).sum(1), counts_PL.sum(1)]).tolist()
        send_splits_P, recv_splits_P = tuple(host[:P]), tuple(host[P:])
        x_recv_ND = all_to_all_rows(x_SD, list(recv_splits_P), list(send_splits_P), self.group)
        sort_N, unsort_N = _source_major_to_expert_major(counts_PL, x_recv_ND.shape[0])
        x_ND = gather_rows(x_recv_ND, sort_N)
        handle = AllToAllHandle(order_M, num_kept, topk_weights_TK, send_splits_P, recv_splits_P, unsort_N)
        return x_ND, counts_PL.sum(0), handle

    def combine(self, y_ND, handle: AllToAllHandle):
        y_recv_ND = gather_rows(y_ND, handle.unsort_N)  # back to [source][expert]; padding rows past N unread
        y_SD = all_to_all_rows(y_recv_ND, list(handle.send_splits_P), list(handle.recv_splits_P), self.group)
        return weighted_sum_over_slots(y_SD, handle.order_M, handle.num_kept, handle.topk_weights_TK)


def _source_major_to_expert_major(counts_PL: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Received rows come as blocks [source p][expert l]; return (sort_N, unsort_N) where
    x_recv_ND[sort_N] lists them as blocks [expert l][source p] and y_ND[unsort_N] restores the received order.

    Each block keeps its inner order, so a source's tokens for one expert stay in their token order.
    """
    P, L = counts_PL.shape
    device = counts_PL.device
    start_PL = (torch.cumsum(counts_PL.reshape(-1), 0) - counts_PL.reshape(-1)).view(P, L)
    counts_B, start_B = counts_PL.t().reshape(-1), start_PL.t().reshape(-1)  # blocks B in [l][p] order
    dest_start_B = torch.cumsum(counts_B, 0) - counts_B
    # output_size=N (known on the host) keeps repeat_interleave from syncing on the device.
    src_start_N = torch.repeat_interleave(start_B, counts_B, output_size=N)
    dest_start_N = torch.repeat_interleave(dest_start_B, counts_B, output_size=N)
    sort_N = src_start_N + torch.arange(N, device=device) - dest_start_N
    unsort_N = torch.empty_like(sort_N)
    unsort_N[sort_N] = torch.arange(N, device=device)
    return sort_N, unsort_N
