"""Run a function on every rank of a local gloo group (spawned processes), with every wait bounded.

    run_ranks(world_size, fn, *args)   # calls fn(rank, world_size, *args) in each process

`fn` must be a module-level function (spawn pickles it by name). Each worker writes a report file: "ok"
or its traceback; the caller fails with every worker's traceback, and with the exit code of a worker
that died or hung without one. Results travel through files that `fn` writes itself.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bootstrap(rank: int, world_size: int, port: int, report_dir: str, fn, args, environ: dict[str, str]) -> None:
    # A forked rank has the forkserver's environment, from when it started: take the caller's of now, as a spawned
    # rank would (a test's monkeypatched credentials or endpoint).
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)  # the ranks share two cores: one thread each avoids oversubscription
    report = Path(report_dir) / f"rank{rank}"
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        # gloo connects its full mesh without a final handshake: a rank whose fn uses no collective could
        # exit while a peer is still connecting to it ("Connection closed by peer"). Barriers on both sides.
        dist.barrier()
        fn(rank, world_size, *args)
        dist.barrier()
        text = "ok"
    except BaseException:
        text = traceback.format_exc()
    tmp = report.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(report)  # the parent never reads a half-written report
    if dist.is_initialized() and text == "ok":
        dist.destroy_process_group()


def preload(*modules: str) -> None:
    """What the forkserver imports before it forks ranks: only the first call before the server starts counts (a
    later test's modules are imported by each rank as it unpickles its function, still without torch's import)."""
    mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", "dist_harness", *modules])


def run_ranks(world_size: int, fn, *args, timeout: float = 120.0, grace: float = 5.0,
              start_method: str = "forkserver") -> None:
    """Spawn `world_size` ranks running fn; fail (with the workers' tracebacks) unless all report ok.

    start_method "forkserver" (the default) forks the ranks from one server per test process that has imported what
    the first caller preloaded (`preload`), saving each rank seconds of imports (4 spawned ranks: 3.4 s, forked:
    0.25 s); "spawn" starts each afresh.

    When one rank fails, the others are likely blocked in a collective that will never complete: they
    get `grace` seconds to finish, then are terminated, rather than waiting for the gloo timeout.
    """
    ctx = mp.get_context(start_method)
    with tempfile.TemporaryDirectory(prefix="moerl-dist-") as report_dir:
        port = free_port()
        procs = [
            ctx.Process(target=_bootstrap, args=(r, world_size, port, report_dir, fn, args, dict(os.environ)),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        reports = [Path(report_dir) / f"rank{r}" for r in range(world_size)]
        deadline, failed_at = time.monotonic() + timeout, None
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            failed = any(p.exitcode not in (None, 0) for p in procs) or any(
                f.is_file() and f.read_text() != "ok" for f in reports
            )
            if failed and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace:
                break
            time.sleep(0.05)
        timed_out = time.monotonic() >= deadline
        for p in procs:  # only the processes started above
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
            p.join(5)
        errors = []
        for r, (p, f) in enumerate(zip(procs, reports)):
            text = f.read_text() if f.is_file() else None
            if text is None:
                errors.append(f"rank {r}: no report (exit code {p.exitcode}; killed, crashed or timed out)")
            elif text != "ok":
                errors.append(f"rank {r} failed:\n{text}")
        if errors:
            if timed_out:
                errors.insert(0, f"the {world_size} ranks did not finish within {timeout:.0f} s")
            pytest.fail("\n".join(errors), pytrace=False)
