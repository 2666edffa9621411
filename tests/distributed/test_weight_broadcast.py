"""The broadcast weight transport on gloo: member processes driven by this one over queues, the store hosted
here. Bucket buffers of mixed dtypes (and an empty one) arrive bitwise over successive versions; a member
killed before or during a broadcast fails the sender's broadcast within a bound, and the survivors go on in the
next generation; a member that never comes fails formation within a bound.

Every wait here is bounded; a member's failure shows as its traceback. Members are forked from a forkserver that
has imported torch once (spawning each would cost seconds of imports on a small box).
"""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from moerl.actors.weight_sync.broadcast import BroadcastFailed, BroadcastGroup
from moerl.rendezvous import connect_store, host_store
from moerl.actors.weight_sync.buckets import Layout, plan, views

pytestmark = pytest.mark.distributed
TIMEOUT_S = 5.0  # the group's: formation and each buffer
BOUND_S = 30.0  # how long a failure may take to show
WAIT_S = 60.0  # how long this process waits for any member's answer


def layouts() -> list[Layout]:
    """Buckets as the trainer plans them (bf16 and fp32 weights, integer buffers, sizes not multiples of 64, a
    6.6 MB one among small ones), then an empty bucket."""
    items = [("embed", torch.bfloat16, (3000, 1100), None), ("norm", torch.float32, (33,), None),
             ("router", torch.float32, (64, 37), None), ("counts", torch.int64, (3, 5), None),
             ("experts", torch.bfloat16, (4, 96, 80), 0), ("bias", torch.int32, (7,), None)]
    return plan(items, bucket_bytes=16 << 10) + [Layout((), 0)]


def fill(buffers: list[torch.Tensor], version: int) -> None:
    """Version `version`'s contents, the same in every process (typed values, so every dtype's bits travel)."""
    g = torch.Generator().manual_seed(version)
    for buf, layout in zip(buffers, layouts()):
        for _, view, _ in views(buf, layout):
            if view.dtype.is_floating_point:
                view.copy_(torch.randn(view.shape, generator=g) * version)
            else:
                view.copy_(torch.randint(-2**31, 2**31 - 1, view.shape, generator=g, dtype=torch.int64))


def member(port: int, commands, results) -> None:
    """A member process: forms groups, sends or receives versions into buffers allocated once."""
    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, TIMEOUT_S)
    buffers = [torch.zeros(layout.nbytes, dtype=torch.uint8) for layout in layouts()]
    group: BroadcastGroup | None = None
    while True:
        cmd, *args = commands.get(timeout=WAIT_S)
        t0 = time.monotonic()
        try:
            if cmd == "form":
                generation, rank, world = args
                group = BroadcastGroup(store, generation, rank, world, "cpu", TIMEOUT_S)
                results.put((cmd, "ok", time.monotonic() - t0))
            elif cmd == "send":  # the trainer's way: fill, broadcast on the group's thread, hear back later
                fill(buffers, args[0])
                done = group.broadcast_async(buffers, src=0)
                results.put(("submitted", "ok", 0.0))
                done.result(timeout=WAIT_S)
                results.put((cmd, "ok", time.monotonic() - t0))
            elif cmd == "recv":
                group.broadcast(buffers, src=0)
                expected = [torch.zeros_like(b) for b in buffers]  # padding bytes stay zero
                fill(expected, args[0])
                same = all(torch.equal(b, e) for b, e in zip(buffers, expected))
                results.put((cmd, "ok" if same else "bytes differ", time.monotonic() - t0))
            elif cmd == "close":
                group.close()
                group = None
                results.put((cmd, "ok", time.monotonic() - t0))
            elif cmd == "exit":
                return
        except BroadcastFailed as e:
            results.put((cmd, f"BroadcastFailed: {e}", time.monotonic() - t0))
        except BaseException:
            results.put((cmd, traceback.format_exc(), time.monotonic() - t0))


class Members:
    """Member processes, each with its own command queue and results queue."""

    def __init__(self, n: int, port: int) -> None:
        ctx = mp.get_context("forkserver")
        self.commands = [ctx.Queue() for _ in range(n)]
        self.results = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=member, args=(port, c, r), daemon=True)
                      for c, r in zip(self.commands, self.results)]
        for p in self.procs:
            p.start()

    def tell(self, who: list[int], *cmd) -> None:
        for i in who:
            self.commands[i].put(cmd)

    def answer(self, i: int, cmd: str, timeout: float = WAIT_S) -> tuple[str, float]:
        try:
            got, status, seconds = self.results[i].get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"member {i}: no answer to {cmd!r} within {timeout:.0f} s (exit code {self.procs[i].exitcode})")
        assert got == cmd, f"member {i}: answered {got!r} for {cmd!r}: {status}"
        return status, seconds

    def ok(self, who: list[int], cmd: str) -> None:
        for i in who:
            status, _ = self.answer(i, cmd)
            assert status == "ok", f"member {i}, {cmd}: {status}"

    def kill(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].join(10)
        assert self.procs[i].exitcode == -signal.SIGKILL

    def close(self) -> None:
        for i, p in enumerate(self.procs):
            if p.is_alive():
                self.commands[i].put(("exit",))
        for p in self.procs:  # only the processes started above
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.fixture(scope="module", autouse=True)
def forkserver():
    mp.get_context("forkserver").set_forkserver_preload(["torch", "moerl.actors.weight_sync.broadcast", __name__])


@pytest.fixture
def store():
    return host_store("127.0.0.1", 0, TIMEOUT_S)


@pytest.fixture
def members(store):
    made: list[Members] = []

    def start(n: int) -> Members:
        made.append(Members(n, store.port))
        return made[-1]

    yield start
    for m in made:
        m.close()


def broadcast(m: Members, sender: int, receivers: list[int], version: int) -> None:
    m.tell([sender], "send", version)
    m.tell(receivers, "recv", version)
    m.ok([sender], "submitted")
    m.ok(receivers, "recv")
    m.ok([sender], "send")


def test_versions_arrive_bitwise(members):
    m = members(3)
    for i in range(3):
        m.tell([i], "form", 1, i, 3)
    m.ok([0, 1, 2], "form")
    for version in (1, 2, 3):  # the same buffers every version, on both sides
        broadcast(m, 0, [1, 2], version)
    m.tell([0, 1, 2], "close")
    m.ok([0, 1, 2], "close")


@pytest.mark.parametrize("when", ["before", "during"])
def test_dead_member_fails_the_sender_then_survivors_go_on(members, when):
    m = members(3)
    for i in range(3):
        m.tell([i], "form", 1, i, 3)
    m.ok([0, 1, 2], "form")
    broadcast(m, 0, [1, 2], version=1)
    if when == "before":
        m.kill(2)
        m.tell([0], "send", 2)
        m.tell([1], "recv", 2)
        m.ok([0], "submitted")
    else:  # member 2 never takes part in version 2, so the sender cannot have finished when it dies
        m.tell([0], "send", 2)
        m.tell([1], "recv", 2)
        m.ok([0], "submitted")
        m.kill(2)
    status, seconds = m.answer(0, "send", timeout=BOUND_S + 5)
    assert status.startswith("BroadcastFailed: weight broadcast, generation 1"), status
    assert seconds < BOUND_S, f"the sender took {seconds:.1f} s to see the dead member"
    status, seconds = m.answer(1, "recv", timeout=BOUND_S + 5)  # the survivor fails too, in bounded time
    assert status.startswith("BroadcastFailed") and seconds < BOUND_S, (status, seconds)
    m.tell([0], "send", 2)  # a failed generation fails every later call at once
    m.ok([0], "submitted")
    status, seconds = m.answer(0, "send")
    assert status.startswith("BroadcastFailed") and seconds < TIMEOUT_S, (status, seconds)
    m.tell([0, 1], "close")
    for i in (0, 1):  # closing a failed generation is prompt
        status, seconds = m.answer(i, "close")
        assert status == "ok" and seconds < TIMEOUT_S, (i, status, seconds)
    for i in (0, 1):
        m.tell([i], "form", 2, i, 2)
    m.ok([0, 1], "form")
    broadcast(m, 0, [1], version=3)


def test_formation_without_a_member_fails_in_bounded_time(store):
    t0 = time.monotonic()
    with pytest.raises(BroadcastFailed, match=r"generation 7: .*ranks \[1, 2\] did not join"):
        BroadcastGroup(store, 7, 0, 3, "cpu", timeout_s=2.0)
    assert time.monotonic() - t0 < 2.0 + 10.0


def test_a_closed_group_fails_at_once(store):
    group = BroadcastGroup(store, 1, 0, 1, "cpu", TIMEOUT_S)  # a group of one: formed and used in-process
    buf = torch.arange(100, dtype=torch.uint8)
    group.broadcast([buf], src=0)
    group.close()
    t0 = time.monotonic()
    with pytest.raises(BroadcastFailed, match="closed"):
        group.broadcast([buf], src=0)
    assert time.monotonic() - t0 < 1.0
