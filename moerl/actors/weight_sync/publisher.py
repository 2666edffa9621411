"""A trainer rank's side of weight sync: its share of the policy, cast once into bucket buffers, in the forms
the workers can take ("shared": same-node buffers; "store": object-store buckets; "broadcast": a collective)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moerl.actors.weight_sync.broadcast import BroadcastShard
from moerl.actors.weight_sync.buckets import Bucket, Layout, plan, views
from moerl.actors.weight_sync.shared import SharedBuffers, remove_stale_files
from moerl.model import is_expert_param
from moerl.train.trainer import PolicyTrainer


class Publisher:
    def __init__(self, trainer: PolicyTrainer, expert_parallel: bool, bucket_bytes: int,
                 timeout_s: float = 60.0, host: str = "") -> None:
        self.trainer = trainer
        self.host = host  # where the broadcast's rendezvous store listens; "" = this node's address
        blocks = trainer.model.moe_blocks
        offset = blocks[0].dispatcher.expert_offset if blocks and expert_parallel else None
        self.layouts: list[Layout] = plan(
            [(name, dtype, shape, offset if expert_parallel and is_expert_param(name) else None)
             for name, dtype, shape in trainer.publish_spec()], bucket_bytes)
        self.device = torch.device(trainer.device)
        self._shared: SharedBuffers | None = None
        self._host: list[torch.Tensor] | None = None  # pinned on a GPU rank: the store form's staging
        self._filled: tuple[int, list[torch.Tensor]] | None = None  # (version, the buffers holding it)
        self.timeout_s = timeout_s
        self._send: list[torch.Tensor] | None = None  # the broadcast's buffers: untouched while a send runs
        self._sender: ThreadPoolExecutor | None = None  # forms groups and sends, so training never waits on it
        self._job: Future | None = None
        self._group = None  # (generation, BroadcastGroup)
        self._retired = None  # a BroadcastGroup closed after a failed send, maybe still being dropped
        self._store = None

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

    def broadcast(self, version: int, generation: int, world: int) -> tuple[list[BroadcastShard], str]:
        """Fill the send buffers with `version` and start sending them to generation `generation` of the group
        (formed first when new) on a thread of its own. Returns the shard the members take and why the previous
        send failed ("" when it did not): the driver then forms the next generation without the lost member."""
        from moerl.actors.weight_sync.broadcast import node_address
        from moerl.rendezvous import host_store

        failed = self._wait_send()
        if not self.layouts:  # this rank publishes nothing (a data-parallel rank > 0): no group to form
            return [], failed
        host = self.host or node_address()
        if self._store is None:
            self._store = host_store(host, timeout_s=self.timeout_s)
            self._sender = ThreadPoolExecutor(1, thread_name_prefix="moerl-broadcast")
            self._send = [torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device) for layout in self.layouts]
        self.fill(self._send)
        self._filled = (version, self._send)  # read (never written) by a catch-up's export while it is sent
        self._job = self._sender.submit(self._send_job, generation, world)
        shard = BroadcastShard(host, self._store.port, generation, world,
                               tuple(self.layouts), self.timeout_s)
        return [shard], failed

    def _send_job(self, generation: int, world: int) -> None:
        from moerl.actors.weight_sync.broadcast import BroadcastGroup

        if self._group is None or self._group[0] != generation:
            if self._group is not None:
                self._group[1].close()
            self._group = None
            if self._retired is not None:  # the generation closed on a failure: wholly gone before the next forms
                self._retired.wait_closed()
                self._retired = None
            self._group = (generation, BroadcastGroup(self._store, generation, 0, world, self.device, self.timeout_s))
        self._group[1].broadcast(self._send, src=0)

    def _wait_send(self) -> str:
        """Wait (bounded: every step of a send is) for the previous send; why it failed, or ""."""
        job, self._job = self._job, None
        if job is None:
            return ""
        try:
            job.result(timeout=3 * self.timeout_s)
            return ""
        except Exception as e:  # noqa: BLE001 - BroadcastFailed, or a formation that timed out
            if self._group is not None:
                self._group[1].close()
                self._retired, self._group = self._group[1], None
            return f"{type(e).__name__}: {e}"

    def export(self, version: int) -> list | None:
        """The object-store form of `version` when this rank's buffers still hold it (a late worker's catch-up
        after a publish in other forms); None when a newer version overwrote it."""
        if self._filled is None or self._filled[0] != version:
            return None if self.layouts else []
        return self.store(version)

    def publish(self, version: int, forms: tuple[str, ...], group: tuple[int, int] | None = None) -> dict[str, list]:
        out: dict = {}
        if "shared" in forms:
            out["shared"] = self.shared(version)
        if "store" in forms:
            out["store"] = self.store(version)
        if "broadcast" in forms and group is not None:
            out["broadcast"], out["broadcast_failed"] = self.broadcast(version, *group)
        return out

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
        if self._group is not None:
            self._group[1].close()
        if self._sender is not None:
            self._sender.shutdown(wait=False, cancel_futures=True)
