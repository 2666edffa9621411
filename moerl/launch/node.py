"""What a `moerl launch` pod runs (imports neither torchx nor Kubernetes; Ray lazily).

    python -m moerl.launch.node train                       # local: `moerl train` with its own Ray
    python -m moerl.launch.node trainer --rank R --nodes N   # rank 0: Ray head, then the controller; others join
    python -m moerl.launch.node rollout --head HOST:PORT     # join with the `rollout` resource; drain on SIGTERM

The job's resolved config travels base64-encoded in $MOERL_CONFIG_B64 (no file to ship, no macro or shell
quoting in the way); `--config PATH` reads a file instead. A rollout pod that gets SIGTERM (a spot drain)
forwards it to its `ray::RolloutWorker` processes first, so they hand back their work, and stops Ray once
they have exited or `--grace-s` less 20 s has passed. A rollout pod waits up to `--wait-s` for the Ray
head (at start and whenever the head goes away) and exits 0 when none comes: the trainer job is over.

Exit status of a trainer pod: `moerl train`'s (0 finished, 1 failed, 2 bad input, 143 stopped by SIGTERM after
its shutdown save); a rank > 0 exits 143 when stopped by SIGTERM and 1 when its Ray head went away, so a drained
trainer job is never marked succeeded.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

CONFIG_ENV = "MOERL_CONFIG_B64"
STOPPED_BY_SIGTERM = 128 + signal.SIGTERM  # 143: the exit status of a trainer pod stopped by SIGTERM


def encode_config(toml_text: str) -> str:
    return base64.b64encode(toml_text.encode()).decode()


def config_path(path: str = "") -> str:
    """`path`, or the config from $MOERL_CONFIG_B64 written to a temporary file."""
    if path:
        return path
    if CONFIG_ENV not in os.environ:
        raise SystemExit(f"error: no config: pass --config PATH or set ${CONFIG_ENV}")
    fd, out = tempfile.mkstemp(prefix="moerl-", suffix=".toml")
    with os.fdopen(fd, "wb") as f:
        f.write(base64.b64decode(os.environ[CONFIG_ENV]))
    return out


def _ray(*args: str) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


def _log(msg: str) -> None:
    print(f"[moerl.launch.node] {msg}", flush=True)


def wait_for_head(host: str, port: int, deadline: float, stop: threading.Event | None = None) -> bool:
    """True once `host:port` accepts a TCP connection (DNS may not resolve yet); False past `deadline`."""
    while not (stop and stop.is_set()):
        try:
            with socket.create_connection((host, port), timeout=5):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(2.0, max(deadline - time.monotonic(), 0.0)))
    return False


def procs_named(prefix: str) -> list[int]:
    """Pids whose command line (the process title Ray sets, e.g. `ray::RolloutWorker`) starts with `prefix`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").startswith(prefix):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def drain(prefix: str, budget_s: float) -> None:
    """SIGTERM every process named `prefix` and wait (at most `budget_s`) for them to exit."""
    pids = procs_named(prefix)
    _log(f"SIGTERM: forwarding to {len(pids)} {prefix} process(es), waiting up to {budget_s:.0f} s")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.5)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (exited, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _die_with_parent() -> None:
    """In the child: SIGTERM when this process dies, however it dies (Linux prctl PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))


class RayNode:
    """`ray start ... --block` as a child: stopping it stops this node's Ray processes only (not `ray stop`,
    which would stop every Ray on the machine)."""

    STARTUP_S = 120.0  # `ray start` gives up after 30 s without the raylet registering (hard-coded in Ray)

    def __init__(self, *args: str, drain_s: float = 30.0) -> None:
        env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(drain_s)}
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(_ray("start", *args, "--block"), env=env,
                                     preexec_fn=_die_with_parent)  # noqa: PLW1509 - one prctl call, no locks

    def alive(self) -> bool:
        return self.proc.poll() is None

    def failed_to_start(self) -> bool:
        """It exited with an error soon after starting: `ray start` failed (e.g. "the current node timed out during
        startup" when the GCS is busy with other nodes joining at once), not a node that ran and then died."""
        rc = self.proc.poll()
        return rc not in (None, 0) and time.monotonic() - self.started_at < self.STARTUP_S

    def stop(self, timeout: float = 45.0) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_node(node: RayNode, stop: threading.Event, head: tuple[str, int], lost_s: float,
             on_stop: Callable[[], None] | None = None, linger_s: float = 0.0) -> str:
    """Watch `node` until it exits ("exited"), `stop` is set ("stopped": `on_stop`, then the node stops, after
    lingering up to `linger_s` while the head is still up) or the head has refused connections for `lost_s`
    ("head lost": the node stops). The head is checked every 5 s, or twice within `lost_s` when that is shorter."""
    every_s = min(5.0, max(lost_s / 2, 0.5))
    last_seen = next_check = time.monotonic()
    while node.alive():
        if stop.wait(0.5):
            if on_stop:
                on_stop()
            _linger(node, head, linger_s)
            node.stop()
            return "stopped"
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + every_s
            if wait_for_head(*head, deadline=time.monotonic() + 0.1):
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen > lost_s:
                _log(f"Ray head {head[0]}:{head[1]} unreachable for {lost_s:.0f} s")
                node.stop()
                return "head lost"
    return "exited"


def _linger(node: RayNode, head: tuple[str, int], linger_s: float) -> None:
    """A trainer rank > 0 on a drain: every pod gets SIGTERM at once, and rank 0's shutdown save needs this
    node's trainer rank. Keep the node up until the head has stopped (the save is done) or `linger_s` passed."""
    if linger_s <= 0:
        return
    _log(f"SIGTERM: this node stays up for rank 0's shutdown save (until the head stops, at most {linger_s:.0f} s)")
    deadline = time.monotonic() + linger_s
    while node.alive() and time.monotonic() < deadline and wait_for_head(*head, deadline=time.monotonic() + 0.1):
        time.sleep(1.0)


def _install_sigterm(stop: threading.Event) -> None:
    signal.signal(signal.SIGTERM, lambda *_: stop.set())


def _split(head: str, default_port: int) -> tuple[str, int]:
    host, _, port = head.rpartition(":") if ":" in head else (head, "", "")
    return host, int(port or default_port)


def cmd_train(a: argparse.Namespace) -> int:
    from moerl.train_cli import main as train_main

    return train_main([config_path(a.config), *a.overrides])


def cmd_trainer(a: argparse.Namespace) -> int:
    """Rank 0: Ray head, wait for the trainer nodes, run the controller. Other ranks: join and block."""
    stop = threading.Event()
    _install_sigterm(stop)
    if a.rank != 0:
        host, port = _split(a.head or os.environ.get(a.head_env, ""), a.port)
        if not host:
            raise SystemExit(f"error: no Ray head address (--head or ${a.head_env})")
        if not wait_for_head(host, port, time.monotonic() + a.wait_s, stop):
            _log(f"no Ray head at {host}:{port} after {a.wait_s} s")
            return 1
        deadline = time.monotonic() + a.wait_s
        while True:
            # drain_s=0: this node stops once the head has (after rank 0's save), and Ray's drain is a request to the
            # head's GCS: it waited out its whole timeout (30 s by default, then 5) for a GCS that was gone
            node = RayNode(f"--address={host}:{port}", drain_s=0)
            how = run_node(node, stop, (host, port), a.lost_s, linger_s=max(a.grace_s - 10, 0))
            if how == "exited" and node.failed_to_start() and time.monotonic() < deadline and not stop.is_set():
                _log(f"`ray start` failed (exit {node.proc.returncode}); joining {host}:{port} again")
                continue  # it never joined: nothing of the trainer job ran here yet
            # stopped by SIGTERM: 143, as rank 0's `moerl train` exits after its shutdown save; head lost or Ray
            # died: 1. Either way not 0: a stopped or failed trainer job is never marked succeeded.
            return STOPPED_BY_SIGTERM if how == "stopped" else 1
    import ray

    config, address = config_path(a.config), f"{ray.util.get_node_ip_address()}:{a.port}"
    head = RayNode("--head", f"--port={a.port}", "--include-dashboard=false", "--disable-usage-stats")
    try:
        deadline = time.monotonic() + 120
        while head.alive() and not wait_for_head(*_split(address, a.port), deadline=time.monotonic() + 1):
            if time.monotonic() > deadline:
                break
        if not head.alive() or time.monotonic() > deadline:
            raise SystemExit(f"error: the Ray head did not start at {address}")
        _wait_for_nodes(address, a.nodes, a.wait_s)
        if stop.is_set():  # SIGTERM while the nodes gathered: nothing trained, nothing to save
            _log("SIGTERM before the run started")
            return STOPPED_BY_SIGTERM
        from moerl.train_cli import main as train_main

        # --resume-if-saved: the trainer job restarts as a whole (launch.trainer_max_retries) and continues from
        # its newest checkpoint; its first start begins the run.
        return train_main([config, f"--ray.address={address}", "--resume-if-saved", *a.overrides])  # its exit status, 143 on SIGTERM
    finally:
        head.stop()


def _wait_for_nodes(address: str, nodes: int, wait_s: float) -> None:
    """Until `nodes` nodes without the `rollout` resource are alive (an explicit address: "auto" may find
    another Ray on the machine)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:  # the head's raylet registers a moment after its GCS port opens
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
            break
        except (ConnectionError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    try:
        while True:
            alive = [n for n in ray.nodes() if n["Alive"] and not n["Resources"].get("rollout", 0)]
            if len(alive) >= nodes:
                _log(f"{len(alive)}/{nodes} trainer nodes are up")
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"error: only {len(alive)}/{nodes} trainer nodes joined within {wait_s} s")
            time.sleep(1)
    finally:
        ray.shutdown()


def cmd_rollout(a: argparse.Namespace) -> int:
    """Join the Ray cluster as a rollout node for as long as there is a head; drain on SIGTERM."""
    stop = threading.Event()
    _install_sigterm(stop)
    host, port = _split(a.head, 6379)
    resources = json.dumps({"rollout": a.rollout_resource})
    while not stop.is_set():
        if not wait_for_head(host, port, time.monotonic() + a.wait_s, stop):
            if not stop.is_set():
                _log(f"no Ray head at {host}:{port} for {a.wait_s:.0f} s: the trainer job is over")
            return 0
        node = RayNode(f"--address={host}:{port}", f"--resources={resources}", drain_s=0)
        how = run_node(node, stop, (host, port), a.lost_s, lambda: drain(a.drain, max(a.grace_s - 20, 1)))
        if how != "stopped":
            _log(f"left the Ray cluster ({how}); waiting for a head again")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moerl.launch.node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="run `moerl train` with a local Ray")
    tr = sub.add_parser("trainer", help="a trainer node: rank 0 is the Ray head and runs the controller")
    tr.add_argument("--rank", type=int, required=True)
    tr.add_argument("--nodes", type=int, default=1, help="trainer nodes rank 0 waits for")
    tr.add_argument("--port", type=int, default=6379, help="Ray head port")
    tr.add_argument("--head", default="", help="HOST[:PORT] of rank 0 (ranks > 0)")
    tr.add_argument("--head-env", default="TORCHX_RANK0_HOST", help="env var holding rank 0's host")
    tr.add_argument("--grace-s", type=float, default=60.0,
                    help="the pod's termination grace period: ranks > 0 stay up this long less 10 s on SIGTERM")
    r = sub.add_parser("rollout", help="a rollout node: joins the Ray cluster with the `rollout` resource")
    r.add_argument("--head", required=True, help="HOST:PORT of the Ray head")
    r.add_argument("--rollout-resource", type=float, default=1.0)
    r.add_argument("--grace-s", type=float, default=90.0, help="the pod's termination grace period")
    r.add_argument("--drain", default="ray::RolloutWorker", help="process title prefix that gets SIGTERM first")
    for q in (t, tr):
        q.add_argument("--config", default="", help=f"config file (default: ${CONFIG_ENV}); "
                       "other --section.key=value options go to `moerl train`")
    for q in (tr, r):
        q.add_argument("--wait-s", type=float, default=1800.0, help="how long to wait for the Ray head / nodes")
        q.add_argument("--lost-s", type=float, default=60.0, help="a head unreachable this long is gone")
    a, overrides = p.parse_known_args(argv)
    a.overrides = overrides
    if a.overrides and (a.cmd == "rollout" or not all(o.startswith("--") and "." in o for o in a.overrides)):
        p.error(f"unrecognized arguments: {' '.join(a.overrides)}")
    return {"train": cmd_train, "trainer": cmd_trainer, "rollout": cmd_rollout}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
