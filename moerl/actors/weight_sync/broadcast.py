"""Broadcast transport: a trainer rank's bucket buffers to rollout workers on other nodes by one collective,
NCCL between GPUs, gloo on the CPU (the CPU-testable twin).

The group is a process-group object of its own, never the default one (the trainer ranks already have theirs),
rendezvoused on a TCPStore that one process hosts (`host_store`) under `moerl-weights/{generation}`. Workers come
and go (spot), so the group is formed again, as a new generation, whenever membership changes; a generation
that lost a member fails its next broadcast (`BroadcastFailed`) within `timeout_s`, never hangs, and is closed.

    store = host_store("0.0.0.0")                         # the trainer; members: connect_store(host, store.port)
    group = BroadcastGroup(store, generation, rank, world, device, timeout_s)
    done = group.broadcast_async(buffers, src=0)           # the sender keeps training meanwhile
    ...                                                    # buffers stay untouched until done.result() returns
    group.broadcast(buffers, src=0)                        # a receiver: fills its buffers in place

Failure detection. gloo: a dead peer's TCP connection closes, so the sender's send to it fails at once; a
receiver whose source died gets the same error, or, where nothing closes, the op's timeout. NCCL: the group is
made with TORCH_NCCL_BLOCKING_WAIT=1, so no watchdog thread runs for it (its watchdog would take the whole
trainer process down on a timeout or a peer's death); `Work.wait(timeout)` polls the work and NCCL's async error
itself, aborts the communicator on either and raises here instead.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from moerl.actors.weight_sync.buckets import Layout

PREFIX = "moerl-weights"
_Backend = torch._C._distributed_c10d.Backend  # what ProcessGroupGloo and ProcessGroupNCCL derive from


@dataclass(frozen=True)
class BroadcastShard:
    """A rank's buckets arriving by broadcast: join generation `generation` of the rank's group (on the store at
    host:port) as member `member` of `world`, then receive into buffers of `layouts`."""

    host: str
    port: int
    generation: int
    world: int
    layouts: tuple[Layout, ...]
    timeout_s: float
    member: int = -1  # set per worker by the driver


class BroadcastFailed(RuntimeError):
    """A generation of the broadcast group cannot be used any more: form the next one."""

    def __init__(self, generation: int, cause: str) -> None:
        super().__init__(f"weight broadcast, generation {generation}: {cause}")
        self.generation, self.cause = generation, cause


def node_address() -> str:
    """This Ray node's address as the cluster knows it (127.0.0.1 for a local run): the one to serve a store on.
    (`ray.util.get_node_ip_address()` returns the host's routed IP instead, so a local store would face the
    network.)"""
    import ray

    worker = ray._private.worker.global_worker
    return getattr(worker, "node_ip_address", None) or ray.util.get_node_ip_address()


class BroadcastGroup:
    """One generation of the group: `world` members; rank r of them is this process.

    Formation waits at most `timeout_s` for every member, and raises BroadcastFailed naming the absent ones.
    Each buffer's broadcast may take at most `timeout_s` too. After a failure every call raises at once.
    """

    def __init__(self, store: dist.Store, generation: int, rank: int, world: int, device: torch.device | str,
                 timeout_s: float) -> None:
        self.generation, self.rank, self.world = generation, rank, world
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        self._failed: BroadcastFailed | None = None
        self._lock = threading.Lock()  # orders submissions: every member must issue broadcasts in the same order
        self._executor = ThreadPoolExecutor(1, f"moerl-bcast-{generation}", initializer=self._thread_init)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pg: _Backend | None = None
        self._last: Future[None] | None = None  # the latest broadcast submitted
        self._work: dist.Work | None = None  # its latest op: gloo's may run on after wait() timed out
        self._closing: threading.Thread | None = None  # drops a group closed while busy (close, wait_closed)
        prefixed = dist.PrefixStore(f"{PREFIX}/{generation}", store)
        try:
            self._rendezvous(prefixed)
            self._pg = self._connect(prefixed)
        except BaseException:
            self._executor.shutdown(wait=False)
            raise

    # ------------------------------------------------------------------ formation
    def _rendezvous(self, prefixed: dist.Store) -> None:
        """Every member present, or BroadcastFailed in timeout_s: neither backend's own connect can be trusted to
        give up in time (NCCL's bootstrap waits without bound for a rank that never calls in)."""
        keys = [f"joined/{r}" for r in range(self.world)]
        try:
            prefixed.set(keys[self.rank], str(os.getpid()))
            prefixed.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - DistStoreError (timeout), DistNetworkError (store gone)
            try:
                absent = [r for r, k in enumerate(keys) if not prefixed.check([k])]
            except Exception:  # noqa: BLE001 - the store itself is gone
                absent = ["?"]
            raise BroadcastFailed(self.generation, f"forming the group of {self.world}: ranks {absent} did not "
                                  f"join within {self.timeout_s:g} s ({e})") from e

    def _connect(self, prefixed: dist.Store) -> _Backend:
        timeout = timedelta(seconds=self.timeout_s)
        try:
            if self.device.type == "cpu":
                # gloo connects its full mesh here, waiting at most `timeout`; ops time out after `timeout` too
                return dist.ProcessGroupGloo(prefixed, self.rank, self.world, timeout)
            if self.device.type != "cuda":
                raise ValueError(f"no broadcast backend for device {self.device}")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            opts.group_name = f"{PREFIX}-{self.generation}"  # for NCCL's logs
            with _nccl_env():
                pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.world, opts)
        except BroadcastFailed:
            raise
        except Exception as e:  # noqa: BLE001
            raise BroadcastFailed(self.generation, f"connecting the group: {e}") from e
        # NCCL connects lazily, at the first collective: connect now, bounded. A blocking ncclCommInitRank cannot be
        # interrupted: should a member die between the rendezvous and here, that thread stays behind (holding `pg`).
        connected = self._executor.submit(pg.eager_connect_single_device, self.device)
        try:
            connected.result(timeout=self.timeout_s)
        except TimeoutError as e:
            raise BroadcastFailed(self.generation, f"connecting NCCL: not done within {self.timeout_s:g} s") from e
        except Exception as e:  # noqa: BLE001 - NCCL's error
            _abort(pg)
            raise BroadcastFailed(self.generation, f"connecting NCCL: {e}") from e
        return pg

    def _thread_init(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # ------------------------------------------------------------------ broadcasts
    def broadcast_async(self, buffers: list[torch.Tensor], src: int) -> Future[None]:
        """Broadcast every buffer from rank `src` (in place elsewhere) on this group's own thread; the future
        completes when all buffers are through, or fails with BroadcastFailed. Until then the buffers must not be
        written (the sender's) or read (a receiver's). Calls run one after another, in submission order."""
        ready = None
        if self._stream is not None:  # the buffers may still be written on the caller's stream: wait for that
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        with self._lock:
            if self._failed is None:
                self._last = self._executor.submit(self._broadcast, list(buffers), src, ready)
                return self._last
        failed: Future[None] = Future()
        failed.set_exception(self._failed)
        return failed

    def broadcast(self, buffers: list[torch.Tensor], src: int) -> None:
        self.broadcast_async(buffers, src).result()

    def _broadcast(self, buffers: list[torch.Tensor], src: int, ready: torch.cuda.Event | None) -> None:
        if self._failed is not None:
            raise self._failed
        pg = self._pg
        if pg is None:
            raise BroadcastFailed(self.generation, "the group is closed")
        timeout = timedelta(seconds=self.timeout_s)
        stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        try:
            with stream:  # NCCL queues behind this stream, not behind the trainer's kernels on the default one
                if ready is not None:
                    self._stream.wait_event(ready)
                for buf in buffers:
                    if buf.numel() == 0:  # same layout everywhere: every member skips the same ones
                        continue
                    opts = dist.BroadcastOptions()
                    opts.rootRank, opts.rootTensor = src, 0
                    # one at a time: a bucket gets the whole timeout; waiting with a timeout raises rather than hangs
                    self._work = pg.broadcast([buf], opts)
                    self._work.wait(timeout)
                # The acknowledgement: in a tree or ring the source may finish before a member further on fails (or
                # dies), so only a collective over all members tells the sender that every member has every byte.
                ack = torch.ones(1, dtype=torch.int32, device=self.device)
                opts = dist.AllreduceOptions()
                opts.reduceOp = dist.ReduceOp.MIN
                self._work = pg.allreduce([ack], opts)
                self._work.wait(timeout)
        except Exception as e:  # noqa: BLE001 - gloo: RuntimeError/DistError; NCCL: DistBackendError
            # Neither this frame (kept alive by the exception's traceback, kept by self._failed) nor the op may hold
            # the group: its destructor must run where close() drops it, never wherever the exception dies
            pg = self._work = None
            self._failed = BroadcastFailed(self.generation, f"broadcast from rank {src}: {e}")
            raise self._failed from None

    # ------------------------------------------------------------------ end
    @property
    def failed(self) -> BroadcastFailed | None:
        return self._failed

    def close(self) -> None:
        """Release the group without waiting: NCCL's communicator is aborted; broadcasts still queued fail at
        once. Dropping the group joins its threads: here when none is busy, else (a gloo op still in flight ends
        within timeout_s) on a helper thread, which `wait_closed` joins. The group is destroyed in exactly one
        place: an intermittent "double free" was seen once when a new generation formed while the old one's
        last reference could die on any thread (an exception's traceback held it)."""
        with self._lock:
            pg, self._pg = self._pg, None
            if self._failed is None:
                self._failed = BroadcastFailed(self.generation, "the group is closed")
        if pg is None:
            return
        if self.device.type == "cuda":
            _abort(pg)
        busy = (self._last is not None and not self._last.done()) or (self._work is not None and
                                                                      not self._work.is_completed())
        if busy:
            self._closing = threading.Thread(target=self._drop, args=(pg,), name="moerl-bcast-close", daemon=True)
            self._closing.start()
        else:  # at once, and before this process may exit (exiting while a helper drops it can abort the process)
            self._drop(pg)

    def wait_closed(self, timeout_s: float | None = None) -> None:
        """Join the helper that drops a group closed while busy (bounded: its last op ends within timeout_s). Call
        before forming the next generation, so that no two groups are built and destroyed at once."""
        if self._closing is not None:
            self._closing.join(timeout=3 * self.timeout_s if timeout_s is None else timeout_s)

    def _drop(self, pg: _Backend) -> None:
        self._executor.shutdown(wait=True)  # the op in flight ends (or times out) first
        self._work = self._last = None
        del pg  # the last reference: ProcessGroupGloo's destructor joins its worker threads here


def _abort(pg: _Backend) -> None:
    try:
        pg.abort()
    except Exception:  # noqa: BLE001 - already aborted, or not supported by this backend
        pass


_ENV_LOCK = threading.Lock()
_NCCL_ENV = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",  # no watchdog thread: failures raise in wait(), they do not end the process
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # should a watchdog run anyway: abort the communicator, keep the process
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # nor a heartbeat monitor that kills the process
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",  # a dead worker is routine here, not a reason for debug dumps
}


@contextmanager
def _nccl_env() -> Iterator[None]:
    """ProcessGroupNCCL reads these at construction; set them for this group only (the trainer's own group keeps
    its settings: it was made before, and later ones see the old values again)."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in _NCCL_ENV}
        os.environ.update(_NCCL_ENV)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
