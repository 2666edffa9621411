"""KV-cache blocks: a free list with reference counts, and a prefix cache of full blocks.

Pure bookkeeping on block ids; the tensors live in kv_cache.py. Block 0 is the null block: padding rows of a
batch write there and padding entries of a block table point there, so it is never handed out.

Prefix cache (as vLLM's automatic prefix caching): a full block is found by its key (the content id of the
block before it, its own tokens), so two token lists that agree on their first n full blocks find the same n
blocks. Content ids are handed out at registration (never a hash of the tokens): two different prefixes can
never collide, and once a block is evicted its id is gone, so blocks chained after it are found no more and
age out of the cache in turn.

A block is registered when a request takes it for positions it will compute ("pending") and becomes "ready"
once computed. A request whose prompt would match a pending block waits to be admitted until it is ready
(`Match.pending`): the G samples of a GRPO group prefill their prompt once, not G times side by side.

Free blocks: `_plain` (no reusable content) and `_cached` (ready content, no reference, least recently
released first). Allocation takes plain blocks first and only then evicts cached ones, oldest first.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

ROOT = 0  # the content id before a token list's first block


@dataclass
class Match:
    blocks: list[int] = field(default_factory=list)  # ready blocks holding the first len(blocks) full blocks
    parent: int = ROOT  # content id of the last matched block: the chain goes on from it
    pending: bool = False  # the next block is being computed by a running request: better to wait for it


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self._plain = list(range(num_blocks - 1, 0, -1))  # pop() hands out the lowest id first
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._by_key: dict[tuple, int] = {}
        self._key_of: dict[int, tuple] = {}
        self._cid_of: dict[int, int] = {}
        self._ready: set[int] = set()
        self._cids = itertools.count(ROOT + 1)
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (plain ones plus evictable cached ones)."""
        return len(self._plain) + len(self._cached)

    def match(self, tokens: Sequence[int], max_blocks: int) -> Match:
        """The longest run of ready cached blocks holding tokens' first full blocks (at most max_blocks)."""
        out, bs = Match(), self.block_size
        for i in range(max_blocks):
            block = self._by_key.get((out.parent, tuple(tokens[i * bs: (i + 1) * bs])))
            if block is None:
                break
            if block not in self._ready:
                out.pending = True
                break
            out.blocks.append(block)
            out.parent = self._cid_of[block]
        return out

    def take(self, blocks: Sequence[int]) -> None:
        """One more reference to each (matched) block; an unreferenced cached block leaves the free list."""
        for b in blocks:
            if self.refs[b] == 0:
                del self._cached[b]
            self.refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, each with one reference; the caller checked `num_free`."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with {self.num_free} free blocks")
        out = []
        for _ in range(n):
            if self._plain:
                b = self._plain.pop()
            else:  # evict the least recently released cached block
                b, _ = self._cached.popitem(last=False)
                self._forget(b)
                self.evictions += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block. Released in reverse so a sequence's last blocks, the least likely to
        be shared, are evicted before its first ones."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] > 0:
                continue
            if b in self._ready and b in self._key_of:
                self._cached[b] = None
            else:
                self._forget(b)
                self._plain.append(b)

    def register(self, block: int, parent: int, tokens: Sequence[int], ready: bool) -> int:
        """Key a full block by (parent content id, tokens) and return the content id to chain from. A key that
        is already taken (another block holds the same content) leaves this block unkeyed and continues the
        chain from the other block's id: the content is the same."""
        key = (parent, tuple(tokens))
        holder = self._by_key.get(key)
        if holder is not None:
            return self._cid_of[holder]
        cid = next(self._cids)
        self._by_key[key], self._key_of[block], self._cid_of[block] = block, key, cid
        if ready:
            self._ready.add(block)
        return cid

    def mark_ready(self, block: int) -> None:
        if block in self._key_of:
            self._ready.add(block)

    def clear_prefixes(self) -> None:
        """Forget every key (new weights: cached keys/values were computed by the old ones). Blocks in use stay
        with their requests; cached ones become plain free blocks."""
        for b in list(self._key_of):
            self._forget(b)
        self._plain.extend(self._cached)
        self._cached.clear()

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._by_key[key]
        self._cid_of.pop(block, None)
        self._ready.discard(block)
