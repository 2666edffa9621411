"""A rollout worker's side of weight sync: published buckets in any form -> tensors on the engine's device ->
copied into the engine between two decode steps.

The double buffer: what the engine thread copies from is always a second copy already on its device (the
trainer's shared buffer, or a staged copy made here off the engine thread), so decode pauses only for a
device-local copy.
"""

from __future__ import annotations

import torch

from moerl.actors.weight_sync.buckets import Bucket, Published, unpack_bucket, views
from moerl.actors.weight_sync.shared import SharedBucket, SharedOpener
from moerl.rollout import Engine


class Receiver:
    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._opener = SharedOpener()

    def receive(self, shards: list) -> Published:
        """The tensors of every shard (object-store refs or buckets, shared-buffer handles), on the engine's device."""
        import ray

        tensors: Published = []
        for shard in shards:
            if isinstance(shard, SharedBucket):  # already on this device: the engine copies straight from it
                tensors.extend(views(self._opener.open(shard), shard.layout))
                continue
            bucket: Bucket = ray.get(shard) if isinstance(shard, ray.ObjectRef) else shard
            tensors.extend(stage(unpack_bucket(bucket), self.device))
        return tensors


def stage(tensors: Published, device: torch.device) -> Published:
    """Copies on the engine's device, made off the engine thread (on the CPU the received views already are)."""
    return [(name, t.to(device), offset) for name, t, offset in tensors]


@torch.no_grad()
def apply_weights(engine: Engine, tensors: Published, version: int) -> None:
    """Copy published tensors into the engine's model; expert slices land at their rank's expert offset.
    Runs on the engine's thread, between two steps."""
    state = engine.model.state_dict()
    whole = [(name, tensor) for name, tensor, offset in tensors if offset is None]
    slices = [(name, tensor, offset) for name, tensor, offset in tensors if offset is not None]
    for name, _, _ in slices:
        if name not in state:
            raise KeyError(f"update_weights: unknown parameter {name!r}")
    engine.update_weights(whole, version)
    for name, tensor, offset in slices:
        state[name][offset: offset + tensor.shape[0]].copy_(tensor)
