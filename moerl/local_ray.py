"""A private local Ray (no `ray.address`): confined to loopback, behind a token of its own run, its files in a
directory only this user can enter.

    loopback_env(local=True)            # before Ray is imported: token auth, and 127.0.0.1 as the node's address
    token = RunToken(); token.open()    # just before ray.init: the run's private (0700) directory, a fresh token
    ray.init(_temp_dir=token.ray_temp_dir, ...)
    shutdown_held(); token.close()      # Ray's processes killed at once, then the directory and all in it go

Ray takes the address a node listens on from its node IP, and `ray.init(_node_ip_address="127.0.0.1")` does not
hold: Ray swaps a loopback address for the host's routed one. Its own switch for single-machine Ray
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when Ray is imported) makes 127.0.0.1 the node's address; then its
GCS, raylet, object manager, agents and workers listen on loopback only (tests/integration/test_local_security.py
lists every listener of a run). A caller that imported Ray before (a notebook, the in-process tests) keeps its own
settings: Ray then listens on every interface, behind its token when RAY_AUTH_MODE=token.

The directory (`moerl-ray-XXXXXXXX` under the system temp dir, 0700): Ray would write ~/.ray/auth_token
world-readable (0644), shared by every run of the user and kept for ever, and its session directories under
/tmp/ray are 0777. A local run gets its own token, in a 0600 file there, named to Ray's processes by
RAY_AUTH_TOKEN_PATH, and Ray's temp dir (`ray/`, its sessions, sockets and logs) beside it. A token the environment
names already (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) is used as it is. The directory records its owner (pid and
process start): one left by a run that was killed (SIGKILL leaves it) is removed at the next start, once its owner is
gone, never while it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator

from moerl.run_dir import proc_stat, process_alive, process_start

LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node address is 127.0.0.1 (ray/_private/services.py)
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
PREFIX = "moerl-ray-"  # the private directories' names under the temp dir
OWNER_FILE = "owner.json"  # in each: the pid and process start of the run that made it


def loopback_env(local: bool) -> None:
    """Before Ray is imported (it reads both when imported); when the caller imported it already, its own stand."""
    if local and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault(LOOPBACK, "0")


@contextlib.contextmanager
def quiet_thread_warning() -> Iterator[None]:
    """Ray warns "SIGTERM handler is not set because current thread is not the main thread" when ray.init runs off
    the main thread, as the run's start does (moerl/startup.py): the driver sets its own handler then, so the line
    would only alarm. Only that message of Ray's worker logger is held back."""
    import logging

    logger = logging.getLogger("ray._private.worker")

    def keep(record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


@contextlib.contextmanager
def inherited_env(env: dict[str, str]) -> Iterator[None]:
    """`env` in this process's environment while it starts a local Ray, restored after: the raylet inherits it, and
    every worker from the raylet. Ray's `runtime_env={"env_vars": ...}` does the same through its runtime-env agent,
    which starts each worker through a process of its own and never uses the idle workers Ray starts ahead of time:
    0.5 s more for each actor (measured on the 2-core box; a run starts 2-4, a respawn one more)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _reset_ray_token_cache() -> None:
    if "ray" in sys.modules:  # Ray's token loader caches what it read: make it read the path we set (or unset)
        from ray._raylet import AuthenticationTokenLoader

        AuthenticationTokenLoader.instance().reset_cache()


class RunToken:
    """The run's private directory (see the module doc): its Ray token and Ray's temp dir. `open` and `close` may each
    be called any number of times, `close` undoing only what `open` did. base: where the directory goes (default:
    the system temp dir, or /tmp when that path is too long for Ray's socket names)."""

    def __init__(self, base: str | None = None) -> None:
        self.base = base
        self.directory: str | None = None
        self._token = False  # whether a token file of ours is there

    @property
    def path(self) -> str | None:
        """The token file, when this run wrote one."""
        return os.path.join(self.directory, "auth_token") if self.directory and self._token else None

    @property
    def ray_temp_dir(self) -> str | None:
        """Ray's temp dir (`ray.init(_temp_dir=...)`), inside the private directory once it is open."""
        return os.path.join(self.directory, "ray") if self.directory else None

    def open(self) -> None:
        if self.directory is not None:
            return
        base = self.base or _temp_base()
        remove_stale(base)
        self.directory = tempfile.mkdtemp(prefix=PREFIX, dir=base)  # 0700
        with open(os.path.join(self.directory, OWNER_FILE), "w") as f:
            json.dump({"pid": os.getpid(), "proc_start": process_start(os.getpid())}, f)
        if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
            return
        if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get(TOKEN_PATH):
            return  # the environment's token stands
        fd = os.open(os.path.join(self.directory, "auth_token"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        self._token = True
        os.environ[TOKEN_PATH] = self.path  # Ray's processes inherit it from this one
        _reset_ray_token_cache()

    def close(self) -> None:
        if self.directory is None:
            return
        if self._token and os.environ.get(TOKEN_PATH) == self.path:
            del os.environ[TOKEN_PATH]
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory, self._token = None, False
        _reset_ray_token_cache()


def remove_stale(base: str) -> list[str]:
    """Remove the private directories under `base` that a run of this user left (a SIGKILL skips `close`) and whose
    owner process is gone; one whose owner runs, or that names none, or another user's, stays. Returns those removed."""
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
                continue
            with open(os.path.join(path, OWNER_FILE)) as f:
                owner = json.load(f)
            pid, start = owner.get("pid"), owner.get("proc_start")
        except (OSError, ValueError, AttributeError):
            continue  # not ours to judge: no owner recorded
        if isinstance(pid, int) and not process_alive(pid, start):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _temp_base() -> str:
    """The system temp dir, unless its path would make Ray's socket paths (under the session directory) too long
    for AF_UNIX (107 bytes): then /tmp."""
    base = tempfile.gettempdir()
    return base if len(base) <= 40 else "/tmp"


def shutdown_held() -> None:
    """`ray.shutdown()` for a local Ray this process started with SIGTERM held (moerl/startup.py). Ray sends each of
    its processes SIGTERM and waits a second before SIGKILL (`allow_graceful`): five processes that hold SIGTERM
    took 5 s of every run's exit for nothing. They get SIGKILL at once, as they would a second later. So do the
    raylet's children (its dashboard and runtime-env agents, its workers): killed at once with the raylet, the
    agents outlived it (Ray's own wait gave them time to see it go). Any other Ray (joined, or started without the
    hold) gets a plain `ray.shutdown()`; so does this one where Ray's node object is not where this looks."""
    import ray

    node = getattr(getattr(getattr(ray, "_private", None), "worker", None), "_global_node", None)
    kill_all = getattr(node, "kill_all_processes", None)
    if kill_all is None or not hasattr(node, "all_processes"):
        ray.shutdown()
        return
    raylets = [info.process.pid for info in node.all_processes.get("raylet", [])]
    children = [(pid, process_start(pid)) for pid in _children(raylets)]
    node.kill_all_processes = lambda check_alive=True, allow_graceful=False, wait=False: kill_all(
        check_alive=check_alive, allow_graceful=False, wait=wait)
    ray.shutdown()
    for pid, start in children:
        if process_alive(pid, start):  # the same process (start tick), not a later one given its pid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _children(parents: list[int]) -> list[int]:
    """The processes whose parent is one of `parents` (Linux's /proc; none elsewhere)."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    return [pid for pid in pids if (fields := proc_stat(pid)) and int(fields[1]) in parents]
