"""A rollout worker's side of weight sync: published buckets in any form -> tensors on the engine's device ->
copied into the engine between two decode steps.

The double buffer: what the engine thread copies from is always a second copy already on its device (the
trainer's shared buffer, or a staged copy made here off the engine thread), so decode pauses only for a
device-local copy.
"""

from __future__ import annotations

import threading

import torch

from moerl.actors.weight_sync.buckets import Bucket, Published, unpack_bucket, views
from moerl.actors.weight_sync.broadcast import BroadcastShard
from moerl.actors.weight_sync.shared import SharedBucket, SharedOpener
from moerl.model.moe import is_expert_param
from moerl.rollout import Engine


class Receiver:
    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._opener = SharedOpener()
        self._groups: dict[tuple[str, int], tuple[int, object, list[torch.Tensor]]] = {}  # (generation, group, buffers)
        # One update at a time, receive through apply: broadcasts are collectives (every member in the same
        # order), and the next one must not refill the buffers the engine is still copying from.
        self.lock = threading.RLock()

    def receive(self, shards: list) -> Published:
        """The tensors of every shard (object-store refs or buckets, shared-buffer handles), on the engine's device."""
        tensors: Published = []
        for shard in shards:
            if isinstance(shard, SharedBucket):  # already on this device: the engine copies straight from it
                tensors.extend(views(self._opener.open(shard), shard.layout))
                continue
            if isinstance(shard, BroadcastShard):  # received into this worker's own buffers (the staged copy)
                tensors.extend(self._receive_broadcast(shard))
                continue
            if not isinstance(shard, Bucket):  # an object-store ref (Ray imported only then: CUDA IPC needs none)
                import ray

                shard = ray.get(shard)
            bucket: Bucket = shard
            tensors.extend(stage(unpack_bucket(bucket), self.device))
        return tensors


    def _receive_broadcast(self, shard: BroadcastShard) -> Published:
        from moerl.actors.weight_sync.broadcast import BroadcastGroup
        from moerl.rendezvous import connect_store

        key = (shard.host, shard.port)  # one group per sending rank
        with self.lock:
            held = self._groups.get(key)
            if held is None or held[0] != shard.generation:
                if held is not None:
                    held[1].close()
                    held[1].wait_closed()  # the old generation gone before the next forms
                self._groups.pop(key, None)
                store = connect_store(shard.host, shard.port, shard.timeout_s)
                group = BroadcastGroup(store, shard.generation, shard.member, shard.world, self.device,
                                       shard.timeout_s)
                buffers = held[2] if held is not None else [
                    torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device) for layout in shard.layouts]
                held = self._groups[key] = (shard.generation, group, buffers)
            try:
                held[1].broadcast(held[2], src=0)
            except Exception:
                held[1].close()
                self._groups.pop(key, None)  # this generation is done for; the driver forms the next one
                raise
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return [t for layout, buf in zip(shard.layouts, held[2]) for t in views(buf, layout)]

    def close(self) -> None:
        for _, group, _ in self._groups.values():
            group.close()
        self._groups.clear()


def stage(tensors: Published, device: torch.device) -> Published:
    """Copies on the engine's device, made off the engine thread (on the CPU the received views already are)."""
    return [(name, t.to(device), offset) for name, t, offset in tensors]


@torch.no_grad()
def apply_weights(engine: Engine, tensors: Published, version: int) -> None:
    """Copy published tensors into the engine's model; expert slices land at their rank's expert offset.
    Runs on the engine's thread, between two steps.

    An engine whose experts are split (an engine group rank, experts [lo, hi)) keeps the part of each expert
    tensor, whole or a trainer rank's slice, that falls in its range: slices of a trainer with another EP size
    are re-cut here."""
    state = engine.model.state_dict()
    blocks = engine.model.moe_blocks
    split = bool(blocks) and blocks[0].dispatcher.world_size > 1
    local = blocks[0].dispatcher.local_expert_slice if split else slice(0, engine.model.config.num_experts)
    whole, slices = [], []
    for name, tensor, offset in tensors:
        if offset is None and not (split and is_expert_param(name)):
            whole.append((name, tensor))
            continue
        start = offset or 0
        lo, hi = max(local.start, start), min(local.stop, start + tensor.shape[0])
        if lo < hi:  # global experts [lo, hi) are rows [lo - local.start, ...) of this rank's tensor
            slices.append((name, tensor[lo - start: hi - start], lo - local.start))
    for name, _, _ in slices:
        if name not in state:
            raise KeyError(f"update_weights: unknown parameter {name!r}")
    engine.update_weights(whole, version)
    for name, tensor, offset in slices:
        state[name][offset: offset + tensor.shape[0]].copy_(tensor)
