"""Needs two GPUs or more (one host), so it is not in the GPU suite (`make test-gpu` runs on one lent H200) nor a
`moerl bench` command; tests/distributed/test_weight_broadcast.py runs the same transport over gloo on the CPU.

The broadcast weight transport over NCCL between the GPUs of one host: one process per GPU, rank 0 the sender
(as a trainer rank: fills its bucket buffers, broadcasts them on the group's thread), the others receivers. Each
version's bytes are checked bitwise on every receiver, and each broadcast is timed:

    python scripts/multi_gpu/broadcast_check.py [--gib 1] [--bucket-mib 256] [--versions 5] [--gpus N]

With --kill the last rank then dies (os._exit) before the next broadcast: the sender and the survivors must get
BroadcastFailed within --timeout (and live on), then the survivors form generation 2 and check a version bitwise
(needs 3 GPUs for that last part). --linger S keeps the processes alive S s more (75 s outlasts the 60 s a
ProcessGroupNCCL watchdog would wait before taking the process down, had one been started).

--device cpu runs the same over gloo (a quick check of the script: --gib 0.05). With fewer than 2 GPUs it says so
and exits 0.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

_CHUNK = 64 << 20  # bytes of the pattern made at a time (an int64 index per byte: 512 MiB of scratch)


def layouts(total_bytes: int, bucket_bytes: int):
    """A model-like bucket set of about `total_bytes`: bf16 matrices in bulk, fp32 norms, int64 counters, and an
    empty bucket at the end."""
    from moerl.actors.weight_sync.buckets import Layout, plan

    per = max(8192, min(32 << 20, total_bytes // 8)) // 8192 * 8192  # bytes of one [rows, 4096] bf16 matrix
    items = []
    for i in range(max(1, total_bytes // per)):
        items += [(f"layers.{i}.w", torch.bfloat16, (per // 8192, 4096), None), (f"layers.{i}.norm", torch.float32,
                  (4096,), None), (f"layers.{i}.counts", torch.int64, (64,), None)]
    return plan(items, bucket_bytes) + [Layout((), 0)]


def pattern(buf: torch.Tensor, seed: int, start: int, n: int) -> torch.Tensor:
    """Bytes [start, start + n) of the pattern `seed` (integer arithmetic: the same on every device)."""
    i = torch.arange(start, start + n, device=buf.device, dtype=torch.int64)
    return ((i * 2654435761 + seed * 97531) >> 11).bitwise_and_(255).to(torch.uint8)


def fill(buffers: list[torch.Tensor], version: int) -> None:
    for b, buf in enumerate(buffers):
        for start in range(0, buf.numel(), _CHUNK):
            n = min(_CHUNK, buf.numel() - start)
            buf[start: start + n] = pattern(buf, 1000 * version + b, start, n)


def same(buffers: list[torch.Tensor], version: int) -> bool:
    for b, buf in enumerate(buffers):
        for start in range(0, buf.numel(), _CHUNK):
            n = min(_CHUNK, buf.numel() - start)
            if not torch.equal(buf[start: start + n], pattern(buf, 1000 * version + b, start, n)):
                return False
    return True


def member(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    from moerl.actors.weight_sync.broadcast import BroadcastFailed, BroadcastGroup
    from moerl.rendezvous import connect_store

    def report(*what) -> None:
        results.put((rank, *what))

    try:
        device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)
        store = connect_store("127.0.0.1", port, args.timeout)
        buffers = [torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
                   for layout in layouts(int(args.gib * 2**30), args.bucket_mib << 20)]
        t0 = time.perf_counter()
        group = BroadcastGroup(store, 1, rank, world, device, args.timeout)
        report("formed", time.perf_counter() - t0)

        start = torch.zeros(1, dtype=torch.uint8, device=device)
        clock = [0.0]  # when the last version's broadcasts began (the sender's buffers full)

        def version(v: int, group: BroadcastGroup) -> None:
            if rank == 0:
                fill(buffers, v)
                sync()
            clock[0] = time.perf_counter()
            group.broadcast([start], src=0)  # every rank starts the clock together, the sender's buffers full
            if rank == 0:
                t0 = time.perf_counter()
                group.broadcast_async(buffers, src=0).result()  # as the trainer does: on the group's thread
                report("sent", v, time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                group.broadcast(buffers, src=0)
                seconds = time.perf_counter() - t0
                report("received", v, seconds, same(buffers, v))

        for v in range(1, args.versions + 1):
            version(v, group)
        if args.kill:
            victim = world - 1
            if rank == victim:
                report("dying")
                results.close()
                results.join_thread()  # the report goes out before the process does
                os._exit(1)  # never takes part in the next broadcast: it cannot complete
            try:
                version(args.versions + 1, group)
                report("not failed", time.perf_counter() - clock[0])
            except BroadcastFailed as e:
                report("failed", time.perf_counter() - clock[0], str(e)[:300])
            group.close()
            if world - 1 >= 2:
                t0 = time.perf_counter()
                group = BroadcastGroup(store, 2, rank, world - 1, device, args.timeout)
                report("formed", time.perf_counter() - t0)
                version(args.versions + 2, group)
            time.sleep(args.linger)
        group.close()
        report("done")
    except BaseException:
        report("error", traceback.format_exc())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="size of the bucket set")
    p.add_argument("--bucket-mib", type=int, default=256)
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--gpus", type=int, default=0, help="how many GPUs (default: all)")
    p.add_argument("--timeout", type=float, default=30.0, help="the group's timeout (formation, each bucket)")
    p.add_argument("--kill", action="store_true", help="then kill the last rank and check the failure path")
    p.add_argument("--linger", type=float, default=0.0, help="with --kill: stay alive this long afterwards")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()

    from moerl.rendezvous import host_store

    world = args.gpus or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if args.device == "cuda" and (torch.cuda.device_count() < 2 or world < 2):
        print(f"broadcast_check needs 2 GPUs; this machine has {torch.cuda.device_count()} (--gpus {args.gpus})")
        return 0
    world = min(world, torch.cuda.device_count()) if args.device == "cuda" else world
    store = host_store("127.0.0.1", 0, args.timeout)
    total = sum(layout.nbytes for layout in layouts(int(args.gib * 2**30), args.bucket_mib << 20))
    print(f"{world} ranks ({args.device}), {total / 1e9:.3f} GB in buckets of {args.bucket_mib} MiB, "
          f"timeout {args.timeout:g} s", flush=True)

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=member, args=(r, world, store.port, args, results), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    ok, done, per_version = True, 0, {}
    expect_done = world - (1 if args.kill else 0)
    deadline = time.monotonic() + 300 + args.linger + (args.versions + 4) * args.timeout
    while done < expect_done and time.monotonic() < deadline:
        try:
            rank, what, *rest = results.get(timeout=5)
        except queue.Empty:
            if all(not proc.is_alive() for proc in procs):
                break
            continue
        if what == "error":
            print(f"rank {rank} failed:\n{rest[0]}", flush=True)
            ok = False
            break
        if what == "done":
            done += 1
        elif what == "formed":
            print(f"rank {rank}: formed in {rest[0]:.2f} s", flush=True)
        elif what == "sent":
            v, seconds = rest
            print(f"version {v}: sent {total / 1e9:.3f} GB in {1e3 * seconds:.1f} ms, {total / seconds / 1e9:.1f} GB/s",
                  flush=True)
        elif what == "received":
            v, seconds, bitwise = rest
            per_version.setdefault(v, []).append(seconds)
            ok &= bitwise
            print(f"version {v}: rank {rank} received in {1e3 * seconds:.1f} ms "
                  f"({total / seconds / 1e9:.1f} GB/s), bitwise equal: {bitwise}", flush=True)
        elif what == "failed":
            print(f"rank {rank}: BroadcastFailed after {rest[0]:.2f} s: {rest[1]}", flush=True)
            ok &= rest[0] < 2 * args.timeout + 10
        elif what == "not failed":
            print(f"rank {rank}: the broadcast with a dead member did NOT fail ({rest[0]:.2f} s)", flush=True)
            ok = False
        else:
            print(f"rank {rank}: {what} {rest}", flush=True)
    if done < expect_done:
        print(f"only {done} of {expect_done} ranks finished", flush=True)
        ok = False
    for proc in procs:  # only the processes started above
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    warm = [max(s) for v, s in per_version.items() if 1 < v <= args.versions]  # the first sets up NCCL's channels
    if warm:
        print(f"best version after the first: {total / min(warm) / 1e9:.1f} GB/s to every receiver", flush=True)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
