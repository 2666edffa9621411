"""A run's start-up waits, each with a deadline that names what it waits for, and a stop that ends them in order.

    run_within(fn, deadline_s=..., what="a local Ray to start", key="ray.start_timeout_s", stop=event.is_set,
               hold_sigterm=True)

A resumed run sat in `ray.init` for over an hour on a loaded machine, holding its run lock, without a word. Every
wait before the first step is bounded now: starting or joining Ray (`ray.start_timeout_s`, here), placing and
building the trainer ranks (`train.start_timeout_s`, moerl/actors/pools.py) and the first rollout workers
(`rollout.start_timeout_s`, the pool's). Past its deadline a wait raises StartupTimeout (exit 1, one line); a stop
(SIGTERM, Ctrl-C) meanwhile raises StartupStopped once the call it waits for has returned, so that the run then
shuts down what it started and releases its locks (exit 130 / 143: nothing was trained).

hold_sigterm: the call runs with SIGTERM blocked in its thread, so every process it starts inherits the block. A
local Ray's GCS, raylet, agents and (through the raylet) its workers then leave a SIGTERM sent to the whole
process group (Slurm's scancel, systemd's stop, `kill -- -PGID`) to the driver, which saves and then shuts them
down; they used to die of it at once, and the run with them (issue 37 item 1). `ray.shutdown()` would wait its 1 s
per process for a SIGTERM they no longer act on (5 s): the run shuts them down with local_ray.shutdown_held(), which
kills them at once. Standard library only.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_SLICE_S = 0.1  # how often a wait looks at its stop


class StartupTimeout(RuntimeError):
    """A start-up wait passed its deadline; the message names what it waited for and the config key."""


class StartupStopped(Exception):
    """A stop (SIGTERM, Ctrl-C) came while the run was starting: nothing was trained, nothing to save."""


def run_within(fn: Callable[[], T], *, deadline_s: float, what: str, key: str, stop: Callable[[], bool],
               hold_sigterm: bool = False, keep_until: threading.Event | None = None,
               clock: Callable[[], float] = time.monotonic) -> T:
    """fn() in a daemon thread, waited for at most `deadline_s`: its value, its exception, StartupTimeout
    ("<what> did not finish within N s (<key>)") or, after it returned, StartupStopped when `stop()` held meanwhile.
    A call past its deadline goes on in its daemon thread: nobody waits for it, and it ends with the process.
    keep_until: the thread lives on after fn until this is set. A process started with a parent-death signal (Ray's
    fate sharing: PR_SET_PDEATHSIG) gets it when the *thread* that started it exits: a local Ray started by a thread
    that then ended had its GCS killed at once."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            if hold_sigterm:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # this thread's: inherited by children
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()
        if keep_until is not None:
            keep_until.wait()

    start = clock()
    threading.Thread(target=call, name="moerl-startup", daemon=True).start()
    stopped = False
    while not done.wait(_SLICE_S):
        stopped = stopped or stop()
        if clock() - start >= deadline_s:
            raise StartupTimeout(f"{what} did not finish within {deadline_s:g} s ({key}): the run stops"
                                 + ("; it was asked to stop meanwhile" if stopped else ""))
    if "error" in box:
        raise box["error"]
    if stopped or stop():
        raise StartupStopped(what)
    return box["value"]
