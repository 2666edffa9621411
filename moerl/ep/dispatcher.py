"""The dispatcher contract: move tokens to the experts that hold them, and the results back.

Shape legend: T tokens on this rank, K experts per token (top-k), D hidden size, E experts in
all, L experts held by this rank, N rows received for this rank's experts (grouped by local expert).

    x_ND, counts_L, handle = dispatcher.dispatch(x_TD, topk_idx_TK, topk_weights_TK)
    y_ND = experts(x_ND, counts_L)                # any row-wise function of the rows
    out_TD = dispatcher.combine(y_ND, handle)     # sum_k topk_weights[t, k] * y(row of (t, k))

Both calls are differentiable: the backward of dispatch is a combine of the gradients and vice versa.
A `topk_idx` of -1 marks a dropped (token, slot) pair (capacity overflow): it is not sent and
contributes zero. Every backend is tested against `LocalDispatcher`, the single-process reference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from moerl.ep.permute import combine_weighted, expand_tokens, sort_by_expert


class BackendUnavailable(RuntimeError):
    """The dispatcher backend asked for cannot run here; the message says why and what to use."""


class Dispatcher(ABC):
    """One contract for every backend; rank r holds experts [r*E/P, (r+1)*E/P)."""

    def __init__(self, num_experts: int, rank: int = 0, world_size: int = 1) -> None:
        if num_experts % world_size != 0:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by the expert-parallel size {world_size}: "
                "every rank must hold the same number of experts"
            )
        self.num_experts = num_experts
        self.rank = rank
        self.world_size = world_size
        self.num_local_experts = num_experts // world_size
        self.expert_offset = rank * self.num_local_experts
        # Set by the MoE layer when a capacity factor is on: topk_idx may then hold -1 (dropped pairs),
        # and the backends pay one host sync to count the kept rows. Dropless routing never syncs here.
        self.may_drop = False

    @property
    def local_expert_slice(self) -> slice:
        return slice(self.expert_offset, self.expert_offset + self.num_local_experts)

    @abstractmethod
    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Return (x_ND grouped by local expert, counts_L int64, handle for combine)."""

    @abstractmethod
    def combine(self, y_ND: torch.Tensor, handle: Any) -> torch.Tensor:
        """Return out_TD in the original token order, weighted by the top-k weights."""


@dataclass(frozen=True)
class LocalHandle:
    order_M: torch.Tensor  # (token, slot) pair index of each sorted row, kept rows first
    num_kept: int
    topk_weights_TK: torch.Tensor


def weighted_sum_over_slots(
    y_ND: torch.Tensor, order_M: torch.Tensor, num_kept: int, topk_weights_TK: torch.Tensor
) -> torch.Tensor:
    """Un-sort rows back to (token, slot) order and reduce over the K slots with the router weights.

    y_ND holds the rows of the first `num_kept` entries of order_M (the kept pairs, sorted by expert).
    """
    if num_kept < y_ND.shape[0]:  # slicing only when needed: a no-op slice still costs a copy in backward
        y_ND = y_ND[:num_kept]
    if num_kept < order_M.shape[0]:
        order_M = order_M[:num_kept]
    return combine_weighted(y_ND, order_M, topk_weights_TK)


class LocalDispatcher(Dispatcher):
    """No expert parallelism: every expert is local. The reference for all other backends."""

    def __init__(self, num_experts: int) -> None:
        super().__init__(num_experts, rank=0, world_size=1)

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK):
        K = topk_idx_TK.shape[1]
        order_M, counts_E, num_kept = sort_by_expert(topk_idx_TK, self.num_experts, self.may_drop)
        x_ND = expand_tokens(x_TD, order_M[:num_kept], K)
        return x_ND, counts_E, LocalHandle(order_M, num_kept, topk_weights_TK)

    def combine(self, y_ND, handle: LocalHandle):
        return weighted_sum_over_slots(y_ND, handle.order_M, handle.num_kept, handle.topk_weights_TK)
