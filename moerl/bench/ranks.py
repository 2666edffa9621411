"""Benchmarks over several ranks: spawned on 127.0.0.1, or one rank per process under torchrun.

    ok, text = spawn_ranks(world, rank_fn, args, timeout_s)   # rank_fn(rank, world, port, args) -> str | None
    device = init_rank(rank, world, port, device_type)        # in rank_fn: the group (gloo or NCCL) and the device

rank_fn must be a module-level function (spawn pickles it by name); rank 0's returned text is the report.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from moerl.rendezvous import connect_store, host_store

# NVLink multicast off (read at NCCL / NVSHMEM init): see the device notes of the machines we are lent.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RankFn = Callable[[int, int, "int | None", object], "str | None"]


def init_rank(rank: int, world: int, port: int | None, device_type: str) -> torch.device:
    """Join the group as `rank` (port None: torchrun's environment) on its device: one CPU thread per rank on
    the CPU (the ranks share the cores), cuda:LOCAL_RANK with NCCL on GPUs."""
    if device_type == "cpu":
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        for k, v in NO_MULTICAST.items():
            os.environ.setdefault(k, v)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    backend = "gloo" if device.type == "cpu" else "nccl"
    # spawned ranks meet on the store spawn_ranks serves on 127.0.0.1 (a tcp:// init_method's store would
    # listen on every interface)
    init = {} if port is None else dict(store=connect_store("127.0.0.1", port), rank=rank, world_size=world)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None, **init)
    return device


def spawn_ranks(world: int, rank_fn: RankFn, args, timeout_s: float) -> tuple[bool, str]:
    """Run `world` ranks in spawned processes on 127.0.0.1; return (ok, rank 0's report or the errors)."""
    import torch.multiprocessing as mp

    store = host_store("127.0.0.1", timeout_s=timeout_s)  # served here for the ranks' lifetime, loopback only
    port = store.port
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moerl-bench-") as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, port, tmp, rank_fn, args), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        reports = [Path(tmp) / f"rank{r}" for r in range(world)]
        deadline, failed_at = time.monotonic() + timeout_s, None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            failed = any(p.exitcode not in (None, 0) for p in procs) or any(
                f.is_file() and not f.read_text().startswith("ok") for f in reports)
            failed_at = failed_at or (time.monotonic() if failed else None)
            if failed_at is not None and time.monotonic() - failed_at > 10:
                break  # the others are likely stuck in a collective
            time.sleep(0.05)
        for p in procs:  # only the processes started above
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
            p.join(5)
        errors = []
        for r, (p, f) in enumerate(zip(procs, reports)):
            text = f.read_text() if f.is_file() else f"no report (exit code {p.exitcode}; crashed or timed out)"
            if not text.startswith("ok"):
                errors.append(f"rank {r}: {text}")
        if errors:
            return False, "\n".join(errors)
        return True, reports[0].read_text()[len("ok\n"):]


def _worker(rank: int, world: int, port: int, report_dir: str, rank_fn: RankFn, args) -> None:
    try:
        text = "ok\n" + (rank_fn(rank, world, port, args) or "")
    except BaseException:
        text = traceback.format_exc()
    report = Path(report_dir) / f"rank{rank}"
    report.with_suffix(".tmp").write_text(text)
    report.with_suffix(".tmp").rename(report)
