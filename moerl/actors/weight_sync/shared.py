"""Same-node transport: the trainer's bucket buffers themselves, opened by the rollout worker in place.

On a GPU a buffer travels as a CUDA IPC handle (a few hundred bytes through Ray); the worker maps the trainer's
memory and the engine copies from it GPU to GPU between two decode steps. On a CPU the same path runs over a
file in /dev/shm mapped by both processes (the CPU-testable twin of CUDA IPC). Either way no weight byte passes
through host memory or the object store.

Who may open what: `Location` says where a process is (Ray node, visible GPUs by UUID); a worker can open a
rank's buffers when it is on the rank's node and, on a GPU, sees the rank's GPU.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass

import torch

from moerl.actors.weight_sync.buckets import Layout

_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_PREFIX = "moerl-weights-"


@dataclass(frozen=True)
class Location:
    node: str  # Ray node id ("" outside Ray)
    gpus: tuple[str, ...] = ()  # UUIDs of the visible GPUs; a trainer rank lists its own first

    @staticmethod
    def here(device: torch.device | str) -> Location:
        try:
            import ray

            node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        except Exception:  # noqa: BLE001 - outside a Ray worker
            node = ""
        device = torch.device(device)
        if device.type != "cuda":
            return Location(node)
        own = device.index if device.index is not None else torch.cuda.current_device()
        order = [own] + [i for i in range(torch.cuda.device_count()) if i != own]
        return Location(node, tuple(str(torch.cuda.get_device_properties(i).uuid) for i in order))

    def can_open(self, rank: Location) -> bool:
        """Can a process here map the buffers of a trainer rank at `rank`?"""
        return self.node == rank.node and (not rank.gpus or rank.gpus[0] in self.gpus)


@dataclass(frozen=True)
class SharedBucket:
    """A handle to one of a trainer rank's bucket buffers."""

    layout: Layout
    where: Location  # the rank's
    cuda_ipc: tuple | None = None  # torch's CUDA IPC rebuild arguments
    path: str = ""  # the /dev/shm file (CPU)


class SharedBuffers:
    """The trainer rank's side: bucket buffers that stay put for the run (their handles stay valid), one set per
    slot. Two slots let the rank fill version v+1 while workers may still copy version v."""

    def __init__(self, layouts: list[Layout], device: torch.device, slots: int = 2) -> None:
        self.layouts, self.device = layouts, torch.device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"shared weight buffers: no same-node sharing for device {self.device}")
        self.where = Location.here(self.device)
        self._paths: list[str] = []
        self.slots = [[self._alloc(layout.nbytes) for layout in layouts] for _ in range(slots)]
        self._handles = [self._export(slot) for slot in range(slots)]  # once: the buffers never move

    def _alloc(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        path = os.path.join(_SHM_DIR, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        self._paths.append(path)
        return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]

    def _export(self, slot: int) -> list[SharedBucket]:
        out = []
        for i, (layout, buf) in enumerate(zip(self.layouts, self.slots[slot])):
            if self.device.type == "cuda":
                from torch.multiprocessing.reductions import reduce_tensor

                out.append(SharedBucket(layout, self.where, cuda_ipc=tuple(reduce_tensor(buf)[1])))
            else:
                out.append(SharedBucket(layout, self.where, path=self._paths[slot * len(self.layouts) + i]))
        return out

    def handles(self, slot: int) -> list[SharedBucket]:
        return self._handles[slot]

    def close(self) -> None:
        """Remove the /dev/shm files (mapped copies stay valid until their holders drop them)."""
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths = []


class SharedOpener:
    """The worker's side: maps a rank's buffers once and keeps them mapped (the rank reuses them every version)."""

    def __init__(self) -> None:
        self._open: dict[object, torch.Tensor] = {}

    def open(self, bucket: SharedBucket) -> torch.Tensor:
        flat = self._open.get(key := self.key(bucket))
        if flat is None:
            flat = self._map(bucket)
            self._open[key] = flat
        return flat

    @staticmethod
    def key(bucket: SharedBucket) -> tuple:
        """What identifies a buffer. On CUDA not the memory handle alone: the caching allocator carves several
        buffers out of one segment, and they share its handle at different offsets (keyed by the handle, every
        other version's buckets were read from another bucket's bytes). So: the handle, the storage's offset in
        the segment, the tensor's offset and size in the storage."""
        if bucket.cuda_ipc is None:
            return ("file", bucket.path)
        ipc = bucket.cuda_ipc  # rebuild_cuda_tensor's arguments: [1] size, [3] offset, [7] handle, [9] offset bytes
        return ("cuda", ipc[7], ipc[9], ipc[3], tuple(ipc[1]))

    @staticmethod
    def _map(bucket: SharedBucket) -> torch.Tensor:
        if bucket.cuda_ipc is None:
            size = bucket.layout.nbytes
            return torch.from_file(bucket.path, shared=True, size=max(size, 1), dtype=torch.uint8)[:size]
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        # The driver sends handles only to workers on the rank's node (Location.can_open); here: which local index
        local = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        if bucket.where.gpus[0] not in local:
            raise RuntimeError(f"shared weights: the trainer's GPU {bucket.where.gpus[0]} is not visible here")
        args = list(bucket.cuda_ipc)
        args[6] = local.index(bucket.where.gpus[0])  # the rank's device index means nothing in this process
        return rebuild_cuda_tensor(*args)


def remove_stale_files() -> None:
    """Delete /dev/shm buffers left by trainer processes that died without closing them."""
    for name in os.listdir(_SHM_DIR):
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
