"""A preallocated slab KV cache: one [slots, G, S+1, d] key and value tensor per decoder layer.

Shape legend: N slots (one per running request), G key/value heads, S max sequence length, d head size,
B rows of one forward, T new positions per row.

Allocated once at engine start, never resized. Column S is a scratch column: rows of a padded decode batch
that belong to no running request write there, so they never touch a live request's cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardPlan:
    """Where one forward writes its keys/values and what it attends over (shared by all layers)."""

    slots_B: torch.Tensor  # int64 cache slot of each row
    write_pos_BT: torch.Tensor  # int64 column each new position writes (S = scratch)
    read_rows: slice | torch.Tensor  # slots to attend over: a contiguous range (a view) or an index (a copy)
    kv_len: int  # columns to attend over
    attn_mask_B1TS: torch.Tensor  # bool, True = attend


class KVView:
    """One layer's cache as seen by one forward: implements moerl.model.layers.KVCacheLayer."""

    def __init__(self, k_NGSd: torch.Tensor, v_NGSd: torch.Tensor, plan: ForwardPlan) -> None:
        self.k_NGSd, self.v_NGSd, self.plan = k_NGSd, v_NGSd, plan

    def update(self, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.plan
        slots_BT = p.slots_B[:, None].expand_as(p.write_pos_BT)
        # Advanced indices on dims 0 and 2 put [B, T] first: the values go in as [B, T, G, d].
        self.k_NGSd[slots_BT, :, p.write_pos_BT] = k_BGTd.transpose(1, 2).to(self.k_NGSd.dtype)
        self.v_NGSd[slots_BT, :, p.write_pos_BT] = v_BGTd.transpose(1, 2).to(self.v_NGSd.dtype)
        if isinstance(p.read_rows, slice):
            return self.k_NGSd[p.read_rows, :, : p.kv_len], self.v_NGSd[p.read_rows, :, : p.kv_len]
        return (self.k_NGSd.index_select(0, p.read_rows)[:, :, : p.kv_len],
                self.v_NGSd.index_select(0, p.read_rows)[:, :, : p.kv_len])


class SlabKVCache:
    def __init__(self, num_layers: int, num_slots: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_slots, num_kv_heads, max_seq_len + 1, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_seq_len = num_slots, max_seq_len

    @property
    def scratch_column(self) -> int:
        return self.max_seq_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def views(self, plan: ForwardPlan) -> list[KVView]:
        return [KVView(k, v, plan) for k, v in zip(self.k, self.v)]
