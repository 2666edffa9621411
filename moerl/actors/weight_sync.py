"""Weight sync: the trainer's newest policy to every rollout worker, publish -> transfer -> apply.

    trainer rank r            object store                rollout worker
    publish_buckets()  ──ray.put──> [bucket refs] ──ray.get──> receive() ──EngineThread──> apply_weights()
    (rank 0: dense tensors; every rank: its expert slice under EP)       (between two decode steps)

`ObjectStoreWeightSync` is the loop's `WeightSync` (moerl/loop/types.py): `publish(v)` queues every rank's
publish behind its current step, `deliver(wait)` hands the bucket refs to every started worker (and keeps them
for workers that start later, see `catch_up`). This is the CPU path and the fallback: each bucket is one flat
byte buffer (`Bucket`), which Ray stores and hands back zero-copy (a numpy array is a view of shared memory,
never pickled tensor by tensor). The worker stages the received tensors on its engine's device off the engine
thread; the engine thread only copies the staged tensors in, between two decode steps.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from moerl.model import is_expert_param
from moerl.rollout import Engine
from moerl.train.trainer import PolicyTrainer

Published = list[tuple[str, torch.Tensor, int | None]]  # (name, tensor, expert offset or None for a whole tensor)
_ALIGN = 64  # byte alignment of each tensor in a bucket (any dtype's view of it is aligned)


@dataclass
class Bucket:
    """Tensors laid end to end in one byte buffer, and where each lies: (name, dtype, shape, byte start,
    expert offset or None)."""

    entries: list[tuple[str, str, tuple[int, ...], int, int | None]]
    data: np.ndarray  # uint8


def pack_bucket(items: Published) -> Bucket:
    """One buffer of the tensors' bytes (one copy each; no per-tensor pickling)."""
    entries, start = [], 0
    for name, t, offset in items:
        entries.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), start, offset))
        start += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    data = np.empty(start, dtype=np.uint8)
    flat = torch.from_numpy(data)
    for (name, _, _, begin, _), (_, t, _) in zip(entries, items):
        n = t.numel() * t.element_size()
        flat[begin: begin + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return Bucket(entries, data)


def unpack_bucket(bucket: Bucket) -> Published:
    """Views of the bucket's buffer (no copy); read-only when the buffer came from the object store."""
    with warnings.catch_warnings():  # a read-only buffer: we only ever read from these views
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(bucket.data)
    out: Published = []
    for name, dtype, shape, begin, offset in bucket.entries:
        dt = getattr(torch, dtype)
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
        out.append((name, flat[begin: begin + n].view(dt).reshape(shape), offset))
    return out


# ---------------------------------------------------------------------------------------- trainer rank side
def publish_buckets(trainer: PolicyTrainer, expert_parallel: bool, bucket_bytes: int) -> list[ray.ObjectRef]:
    """Put this rank's weights in the object store in buckets of about `bucket_bytes` (not one object)."""
    blocks = trainer.model.moe_blocks
    offset = blocks[0].dispatcher.expert_offset if blocks and expert_parallel else None
    buckets, current, size = [], [], 0
    for name, tensor in trainer.publish_state().items():
        sliced = expert_parallel and is_expert_param(name)
        current.append((name, tensor, offset if sliced else None))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            buckets.append(ray.put(pack_bucket(current)))
            current, size = [], 0
    if current:
        buckets.append(ray.put(pack_bucket(current)))
    return buckets


# ---------------------------------------------------------------------------------------- driver side
class ObjectStoreWeightSync:
    """Bucketed weights through the Ray object store, from a trainer group to a worker pool."""

    def __init__(self, trainer: Any, pool: Any, bucket_bytes: int = 32 << 20) -> None:
        self.trainer, self.pool, self.bucket_bytes = trainer, pool, bucket_bytes
        self._publishing: tuple[list, int] | None = None  # (the ranks' publish calls, version)
        self._published: tuple[list, int] | None = None  # (bucket refs, version) not yet delivered
        self.latest: tuple[list, int] | None = None  # (bucket refs, version) delivered last
        pool.weights = self  # workers that start later catch up from `latest`

    def publish(self, version: int) -> None:
        self._publishing = ([r.publish.remote(self.bucket_bytes) for r in self.trainer.ranks], version)
        self._published = None

    def published(self) -> None:
        if self._publishing is None:
            return
        calls, version = self._publishing
        self._publishing = None
        per_rank = ray.get(calls, timeout=self.trainer.timeout_s)
        self._published = ([ref for refs in per_rank for ref in refs], version)

    def deliver(self, wait: bool) -> None:
        self.published()
        self.latest, self._published = self._published, None
        buckets, version = self.latest
        # Workers still starting get the newest weights when they are up, not a backlog of versions.
        refs = [h.update_weights.remote(version, buckets) for h in self.pool.started_handles()]
        if wait:
            for ref in refs:
                try:
                    ray.get(ref, timeout=self.pool.heartbeat_timeout_s)
                except (ray.exceptions.RayError, TimeoutError):
                    pass  # a dead worker is found by the heartbeat

    def catch_up(self, handle: Any, held_version: int) -> ray.ObjectRef | None:
        """The call that brings a worker holding `held_version` to the newest weights; None when it has them."""
        if self.latest is None or held_version >= self.latest[1]:
            return None
        return handle.update_weights.remote(self.latest[1], self.latest[0])


# ---------------------------------------------------------------------------------------- rollout worker side
def receive(shards: list) -> Published:
    """The published tensors of every rank, fetched from the object store (views of its shared memory)."""
    tensors: Published = []
    for shard in shards:
        tensors.extend(unpack_bucket(ray.get(shard) if isinstance(shard, ray.ObjectRef) else shard))
    return tensors


def stage(tensors: Published, device: torch.device) -> Published:
    """Copies on the engine's device, made off the engine thread: applying them is then a device-local copy,
    so decode pauses only for that (the staged copy is the second buffer of a double buffer). On the CPU the
    received views are already that buffer."""
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
