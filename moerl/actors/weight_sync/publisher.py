"""A trainer rank's side of weight sync: its share of the policy, cast once into bucket buffers, in the forms
the workers can take ("shared": same-node buffers; "store": object-store buckets; "broadcast": a collective)."""

from __future__ import annotations

import torch

from moerl.actors.weight_sync.buckets import Bucket, Layout, plan, views
from moerl.actors.weight_sync.shared import Location, SharedBuffers, remove_stale_files
from moerl.model import is_expert_param
from moerl.train.trainer import PolicyTrainer


class Publisher:
    def __init__(self, trainer: PolicyTrainer, expert_parallel: bool, bucket_bytes: int) -> None:
        self.trainer = trainer
        blocks = trainer.model.moe_blocks
        offset = blocks[0].dispatcher.expert_offset if blocks and expert_parallel else None
        self.layouts: list[Layout] = plan(
            [(name, dtype, shape, offset if expert_parallel and is_expert_param(name) else None)
             for name, dtype, shape in trainer.publish_spec()], bucket_bytes)
        self.device = torch.device(trainer.device)
        self.where = Location.here(self.device)
        self._shared: SharedBuffers | None = None
        self._host: list[torch.Tensor] | None = None  # pinned on a GPU rank: the store form's staging
        self._filled: tuple[int, list[torch.Tensor]] | None = None  # (version, the buffers holding it)

    def fill(self, buffers: list[torch.Tensor]) -> None:
        """Gather this rank's share into `buffers` (one per layout), cast to the published dtype on the way."""
        targets = iter([view for layout, buf in zip(self.layouts, buffers) for _, view, _ in views(buf, layout)])
        with torch.no_grad():
            for _, tensor in self.trainer.publish_items():  # every rank runs it through: gathers are collectives
                next(targets).copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # readers in other processes see finished bytes

    def shared(self, version: int) -> list:
        """Handles to buffers holding `version` (slot version % 2: the other slot may still be read)."""
        if self._shared is None:
            if self.device.type == "cpu":
                remove_stale_files()
            self._shared = SharedBuffers(self.layouts, self.device)
        slot = version % len(self._shared.slots)
        self.fill(self._shared.slots[slot])
        self._filled = (version, self._shared.slots[slot])
        return self._shared.handles(slot)

    def store(self, version: int) -> list:
        """Object-store buckets of `version` (copied from the shared buffers when they already hold it)."""
        import ray

        if self._host is None:
            pin = self.device.type == "cuda"
            self._host = [torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin) for layout in self.layouts]
        if self._filled is not None and self._filled[0] == version:
            for host, buf in zip(self._host, self._filled[1]):
                host.copy_(buf, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        else:
            self.fill(self._host)
        # ray.put copies the bytes into the object store, so the host buffers are free again when it returns
        return [ray.put(Bucket(layout, host.numpy())) for layout, host in zip(self.layouts, self._host)]

    def publish(self, version: int, forms: tuple[str, ...]) -> dict[str, list]:
        out = {}
        if "shared" in forms:
            out["shared"] = self.shared(version)
        if "store" in forms:
            out["store"] = self.store(version)
        return out

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
