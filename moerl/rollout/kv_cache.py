"""The paged KV cache: a pool of fixed-size blocks per layer, a block table per request, routing per block.

Shape legend: N blocks in the pool, G key/value heads, P positions per block, d head size, B rows of one
forward, T new positions per row, W blocks per table row, S key positions attended, H query heads,
L MoE layers, K experts per token.

Position p of the request in table row `slot` lives in block table[slot, p // P] at offset p % P. Blocks come
from `BlockPool` (block_pool.py: reference counts, prefix cache). Block 0 is the null block: padding rows of
a decode batch write there, and padding entries of the table point there.

Attention reads only a request's own blocks: decode on CUDA runs the paged Triton kernel (it walks each row's
live positions, and its loop bounds are device tensors, so it replays inside CUDA graphs); elsewhere, and for
prefill, the rows' blocks are gathered up to the longest row and attended with masked SDPA, which computes
exactly what the slab cache's masked SDPA did.

Sharing: only full blocks are shared. A request that matches cached blocks starts computing after them; its
partial last block is its own, recomputed from its tokens rather than copied on write: the tail is under one
block of tokens (a few rows of one batched prefill), every decode write then goes to a block the request owns
alone, and no block-copy step is needed in the graph-captured decode. Memory is the same as copy-on-write,
which would copy that block at the first decode write anyway.

Routing: the experts chosen at each position are kept per block (host memory), so every request sharing a
block reports the routing of its prompt positions without recomputing them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moerl import kernels
from moerl.rollout.block_pool import ROOT, BlockPool


@dataclass
class ForwardPlan:
    """Where one forward writes its keys/values and what each row attends over (shared by all layers)."""

    write_block_BT: torch.Tensor  # int64 block of each new position (0, the null block, for padding rows)
    write_offset_BT: torch.Tensor  # int64 offset in that block
    table_BW: torch.Tensor  # int64 each row's blocks in order, 0-padded
    kv_len: int  # positions gathered per row (gather path)
    mask_B1TS: torch.Tensor | None  # bool, True = attend (gather path)
    seq_len_B: torch.Tensor | None = None  # decode kernel path: positions of each row, the new one included


class PagedKVView:
    """One layer's cache as seen by one forward: implements moerl.model.layers.KVCacheLayer."""

    def __init__(self, k_NGPd: torch.Tensor, v_NGPd: torch.Tensor, plan: ForwardPlan) -> None:
        self.k_NGPd, self.v_NGPd, self.plan = k_NGPd, v_NGPd, plan

    def attend(self, q_BHTd: torch.Tensor, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor) -> torch.Tensor:
        p = self.plan
        # Advanced indices on dims 0 and 2 put [B, T] first: the values go in as [B, T, G, d].
        self.k_NGPd[p.write_block_BT, :, p.write_offset_BT] = k_BGTd.transpose(1, 2).to(self.k_NGPd.dtype)
        self.v_NGPd[p.write_block_BT, :, p.write_offset_BT] = v_BGTd.transpose(1, 2).to(self.v_NGPd.dtype)
        if p.seq_len_B is not None:
            out_BHd = kernels.paged_decode_attention(q_BHTd[:, :, 0], self.k_NGPd, self.v_NGPd, p.table_BW,
                                                     p.seq_len_B)
            return out_BHd[:, :, None]
        k_BGSd = kernels.gather_blocks(self.k_NGPd, p.table_BW, p.kv_len)
        v_BGSd = kernels.gather_blocks(self.v_NGPd, p.table_BW, p.kv_len)
        return F.scaled_dot_product_attention(q_BHTd, k_BGSd, v_BGSd, attn_mask=p.mask_B1TS,
                                              enable_gqa=q_BHTd.shape[1] != k_BGSd.shape[1])


class PagedKVCache:
    """The block pools of every layer plus the per-request bookkeeping the engine asks for.

    A request (the engine's `_Request`) carries `tokens`, `slot` (its table row), `blocks`, `num_computed`,
    and for the prefix cache `chain` (content id of its last keyed block; None: it keys no more blocks) and
    `num_keyed` (its leading blocks that are keyed)."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 max_rows: int, max_seq_len: int, moe_layers: int, top_k: int, dtype: torch.dtype,
                 device: torch.device | str, prefix_caching: bool = True) -> None:
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        # Zeros, not empty: masked positions are multiplied by a zero weight, and 0 * NaN would be NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size, self.prefix_caching, self.device = block_size, prefix_caching, torch.device(device)
        self.width = -(-max_seq_len // block_size)  # table columns: blocks of one full-length request
        self.table_RW = torch.zeros(max_rows, self.width, dtype=torch.long)  # host; 0 = the null block
        self.routing_NPLK = torch.zeros(num_blocks, block_size, moe_layers, top_k, dtype=torch.int16)
        self._routing_rows = self.routing_NPLK.numpy().reshape(num_blocks * block_size, moe_layers * top_k)
        # The Triton kernel where it runs; elsewhere gather + SDPA (CPU tests, no triton).
        self.decode_kernel = kernels.use_triton(self.k[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def views(self, plan: ForwardPlan) -> list[PagedKVView]:
        return [PagedKVView(k, v, plan) for k, v in zip(self.k, self.v)]

    # ------------------------------------------------------------------ requests
    def admit(self, req) -> str:
        """Give req its blocks: "ok"; "wait" (its prompt's next block is being computed by a running request:
        wait for it rather than compute it twice); "full" (its blocks plus one more do not fit yet)."""
        P, tokens = self.block_size, req.tokens
        # At most up to the last token: the request must compute one position at least, to sample from it.
        hit = self.pool.match(tokens, (len(tokens) - 1) // P) if self.prefix_caching else None
        if hit is not None and hit.pending:
            return "wait"
        blocks = hit.blocks if hit is not None else []
        need = -(-len(tokens) // P) - len(blocks)
        revived = sum(1 for b in blocks if self.pool.refs[b] == 0)  # cached blocks counted as free until taken
        if self.pool.num_free - revived < need + 1:
            return "full"
        self.pool.take(blocks)
        req.blocks = blocks + self.pool.allocate(need)
        req.num_computed = len(blocks) * P
        req.chain, req.num_keyed = (hit.parent if hit is not None else None), len(blocks)
        self.table_RW[req.slot, : len(req.blocks)] = torch.tensor(req.blocks)
        self._key(req, len(tokens) // P, ready=False)  # claim the full blocks its prefill will compute
        return "ok"

    def grow(self, req, pos: int | None = None) -> bool:
        """Make room for a decode write at `pos` (default: the next one, num_computed; at most one block past
        req's blocks): one more block when pos is past them. False when none is free. The decode pipeline grows
        for the step after the current one before it knows the current tokens (a block does not depend on them)."""
        pos = req.num_computed if pos is None else pos
        if pos < len(req.blocks) * self.block_size:
            return True
        if self.pool.num_free == 0:
            return False
        block = self.pool.allocate(1)[0]
        self.table_RW[req.slot, len(req.blocks)] = block
        req.blocks.append(block)
        return True

    def computed(self, req, before: int) -> None:
        """req.num_computed went from `before` up: blocks now full of computed positions become reusable."""
        for i in range(before // self.block_size, req.num_computed // self.block_size):
            if i < req.num_keyed:
                self.pool.mark_ready(req.blocks[i])
            else:
                self._key(req, i + 1, ready=True)

    def free(self, req) -> None:
        self.pool.release(req.blocks)
        self.table_RW[req.slot].zero_()  # padding rows of a decode batch must write to the null block
        req.blocks, req.num_computed, req.num_keyed, req.chain = [], 0, 0, ROOT

    def forget_prefixes(self, running) -> None:
        """New weights: no later request may reuse keys/values computed by the old ones."""
        self.pool.clear_prefixes()
        for req in running:
            req.chain = None

    def _key(self, req, upto: int, ready: bool) -> None:
        P = self.block_size
        while self.prefix_caching and req.chain is not None and req.num_keyed < upto:
            i = req.num_keyed
            req.chain = self.pool.register(req.blocks[i], req.chain, req.tokens[i * P: (i + 1) * P], ready)
            req.num_keyed += 1

    # ------------------------------------------------------------------ routing
    def store_routing(self, slots: list[int], pos_BT: torch.Tensor, routing_BTLK: torch.Tensor) -> None:
        """Record the experts chosen at positions pos_BT (host tensors) of the requests in table rows `slots`."""
        block_BT = self.table_RW[torch.tensor(slots)].gather(1, pos_BT // self.block_size)
        # One numpy row assignment into the [blocks x positions, layers x top_k] view: torch's CPU index_put
        # took 3 ms per decode step at 256 rows x 48 layers x 8 (measured on the H200 host), this ~0.05 ms.
        flat = (block_BT * self.block_size + pos_BT % self.block_size).reshape(-1).numpy()
        self._routing_rows[flat] = routing_BTLK.reshape(len(flat), -1).numpy()

    def routing_of(self, req, n: int) -> torch.Tensor:
        """The experts of req's first n positions, [n, L, K] (a copy)."""
        pos_T = torch.arange(n)
        return self.routing_NPLK[torch.tensor(req.blocks, dtype=torch.long)[pos_T // self.block_size],
                                 pos_T % self.block_size]

    # ------------------------------------------------------------------ plans
    def prefill_plan(self, slots: list[int], pos_BT: torch.Tensor) -> ForwardPlan:
        """Rows of new positions pos_BT (host); each attends causally over its own positions."""
        kv_len, P, dev = int(pos_BT.max()) + 1, self.block_size, self.device
        table_BW = self.table_RW[torch.tensor(slots), : -(-kv_len // P)].to(dev)
        pos_BT = pos_BT.to(dev)
        mask_B1TS = (torch.arange(kv_len, device=dev)[None, None, :] <= pos_BT[:, :, None]).unsqueeze(1)
        return ForwardPlan(table_BW.gather(1, pos_BT // P), pos_BT % P, table_BW, kv_len, mask_B1TS)

    def decode_plan(self, pos_B: torch.Tensor, table_BW: torch.Tensor, kv_len: int) -> ForwardPlan:
        """One new position per row (device tensors; static inside a CUDA graph)."""
        P = self.block_size
        write_block_B1 = table_BW.gather(1, (pos_B // P)[:, None])
        if self.decode_kernel:
            return ForwardPlan(write_block_B1, (pos_B % P)[:, None], table_BW, kv_len, None, pos_B + 1)
        key_S = torch.arange(kv_len, device=pos_B.device)
        mask_B11S = (key_S[None, :] <= pos_B[:, None])[:, None, None, :]
        return ForwardPlan(write_block_B1, (pos_B % P)[:, None], table_BW, kv_len, mask_B11S)
