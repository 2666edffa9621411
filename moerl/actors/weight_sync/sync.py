"""The driver's side of weight sync: the loop's `WeightSync` (moerl/loop/types.py) over Ray actors.

Each version the driver asks every trainer rank for the forms its workers can take, and hands every started
worker, per rank, the best one it can take:
- "shared" (same-node buffers, CUDA IPC on a GPU) for a worker that can map the rank's buffers;
- "broadcast" (`weights.transport = "broadcast"`: NCCL, gloo on CPU) for the members of the rank's current
  broadcast group: the started workers when the version was published. When they change (a worker joins, is
  lost, or a send failed), the next publish forms a new generation of the group without waiting for anyone;
- "store" (object-store buckets) for the rest, for workers whose place is not known yet, and for catch-up.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray

from moerl.actors.weight_sync.shared import Location, SharedBucket


class RayWeightSync:
    def __init__(self, trainer: Any, pool: Any, transport: str = "auto", bucket_bytes: int = 256 << 20,
                 timeout_s: float = 60.0) -> None:
        self.trainer, self.pool, self.bucket_bytes, self.timeout_s = trainer, pool, bucket_bytes, timeout_s
        self.transport = transport
        self.rank_where: list[Location] = trainer.get([r.location.remote() for r in trainer.ranks], "start-up")
        if transport == "auto":  # the object store stays the CPU path: shared buffers are for GPUs
            self.transport = "shared" if any(w.gpus for w in self.rank_where) else "object_store"
        self._publishing: tuple[list, int, tuple[str, ...]] | None = None  # (ranks' publish calls, version, forms)
        self._published: tuple[list[dict], int] | None = None  # (per rank: form -> shards, version) to deliver
        self.latest: tuple[list[dict], int] | None = None  # delivered last
        self._reading: dict[int, list] = {}  # version -> update calls that may still read its shared buffers
        self._generation, self._members = 0, ()  # the broadcast group: its generation, its workers (in order)
        self._members_of: dict[int, tuple[str, ...]] = {}  # version -> the members its broadcast went to
        self._exports: dict[int, list] = {}  # version -> the ranks' object-store exports of it, for catch-up
        self._regroup = False  # a send failed: form the next generation even if the members are the same
        self.stats = {"store_publishes": 0, "shared_publishes": 0, "broadcast_publishes": 0,
                      "broadcast_generations": 0, "broadcast_failures": 0}
        pool.weights = self  # workers that start later catch up from `latest`

    # ------------------------------------------------------------------ the loop's WeightSync
    def publish(self, version: int) -> None:
        forms, group = self._forms(), None
        if "shared" in forms:
            self._wait_readers(before=version - 1)  # the rank is about to refill the slot those read
        if "broadcast" in forms:
            members = tuple(wid for wid, _, _ in self.pool.started_workers())
            if members != self._members or self._regroup:
                self._generation, self._members, self._regroup = self._generation + 1, members, False
                self.stats["broadcast_generations"] += 1
            self._members_of = {version: self._members}
            group = (self._generation, 1 + len(self._members))
        self._publishing = ([r.publish.remote(version, forms, self.bucket_bytes, self.timeout_s, group)
                             for r in self.trainer.ranks], version, forms)
        self._published = None
        for form in forms:
            self.stats[f"{form}_publishes"] += 1

    def published(self) -> None:
        if self._publishing is None:
            return
        calls, version, _ = self._publishing
        self._publishing = None
        per_rank = self.trainer.get(calls, f"the publish of version {version}")
        if any(forms.get("broadcast_failed") for forms in per_rank):  # a member was lost mid-send
            self._regroup = True
            self.stats["broadcast_failures"] += 1
        self._published = (per_rank, version)

    def deliver(self, wait: bool) -> None:
        self.published()
        if self._published is None:
            return
        self.latest, self._published = self._published, None
        per_rank, version = self.latest
        self._exports = {v: refs for v, refs in self._exports.items() if v >= version}
        members = self._members_of.get(version, ())
        refs = []
        for worker_id, handle, where in self.pool.started_workers():
            if worker_id in members:  # every member must take part in the collective
                shards = [dataclasses.replace(shard, member=1 + members.index(worker_id))
                          for forms in per_rank for shard in forms.get("broadcast", [])]
            else:
                shards = self._shards(per_rank, where)
            if shards is not None:  # else: it is behind by one version; the next publish includes its form
                refs.append(self._send(handle, version, shards))
        if wait:
            for ref in refs:
                try:
                    ray.get(ref, timeout=self.pool.heartbeat_timeout_s)
                except (ray.exceptions.RayError, TimeoutError):
                    pass  # a dead worker is found by the heartbeat; a failed broadcast forms a new group

    def catch_up(self, handle: Any, held_version: int, where: Location | None = None) -> ray.ObjectRef | None:
        """The call that brings a worker holding `held_version` to the newest weights; None when it has them.
        When the newest version was published in no form this worker can take, it waits for the next one."""
        if self.latest is None or held_version >= self.latest[1]:
            return None
        per_rank, version = self.latest
        shards = self._shards(per_rank, where)
        if shards is None and all("store" not in forms for forms in per_rank):
            # Published in no form it can take: the ranks still hold this version, have them put it in the
            # object store (behind their current step); until then the worker is asked again on each ping.
            exports = self._exports.setdefault(version, [r.export.remote(version) for r in self.trainer.ranks])
            if ray.wait(exports, num_returns=len(exports), timeout=0)[1]:
                return handle.ping.remote()
            refs = self.trainer.get(exports, f"the export of version {version}")
            if any(r is None for r in refs):  # overwritten by a newer version: the next publish carries "store"
                return handle.ping.remote()
            for forms, store in zip(per_rank, refs):
                forms["store"] = store
            shards = self._shards(per_rank, where)
        if shards is None:
            return handle.ping.remote()
        return self._send(handle, version, shards)

    # ------------------------------------------------------------------ forms
    def _forms(self) -> tuple[str, ...]:
        if self.transport == "object_store":
            return ("store",)
        places = self.pool.locations()
        if self.transport == "broadcast":  # workers that are not up yet catch up from the object store
            started = len(self.pool.started_workers())
            return (("broadcast",) if started else ()) + (("store",) if started < len(places) or not started else ())
        if places and all(w is not None and all(w.can_open(r) for r in self.rank_where) for w in places):
            return ("shared",)
        return ("shared", "store")

    def _shards(self, per_rank: list[dict], where: Location | None) -> list | None:
        shards = []
        for rank_where, forms in zip(self.rank_where, per_rank):
            if "shared" in forms and where is not None and where.can_open(rank_where):
                shards.extend(forms["shared"])
            elif "store" in forms:
                shards.extend(forms["store"])
            else:
                return None
        return shards

    def _send(self, handle: Any, version: int, shards: list) -> ray.ObjectRef:
        ref = handle.update_weights.remote(version, shards)
        if any(isinstance(s, SharedBucket) for s in shards):  # it maps the ranks' buffers of `version`
            self._reading.setdefault(version, []).append(ref)
        return ref

    def _wait_readers(self, before: int) -> None:
        """Wait (bounded) until no worker still copies from a version older than `before`: the two slots of
        shared buffers alternate, so publishing v refills the slot that held v - 2."""
        deadline = time.monotonic() + self.timeout_s
        for version in [v for v in self._reading if v < before]:
            for ref in self._reading.pop(version):
                try:
                    ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                except (ray.exceptions.RayError, TimeoutError):
                    # Dead, or its engine is stuck in one step for timeout_s (a zombie: issue 17): the heartbeat
                    # replaces it. Training does not wait longer for one worker.
                    pass
