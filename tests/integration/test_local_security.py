"""The embedded default's network exposure: a local run's own stores listen on 127.0.0.1 only, and its Ray runs
with token authentication, so nothing else on the network can use the servers Ray opens on every interface (Ray
has no setting that binds them all to loopback). The test prints every listener of the run that is not on a
loopback address."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _listeners() -> dict[int, str]:
    """Listening TCP sockets on this machine: inode -> local address."""
    out = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            addr_hex, port_hex = fields[1].split(":")
            if v6:
                addr = "::1" if addr_hex.endswith("01000000") and set(addr_hex[:24]) == {"0"} else (
                    "127.0.0.1" if addr_hex[-8:] == "0100007F" and addr_hex[:24] == "0000000000000000FFFF0000" else
                    addr_hex)
            else:
                addr = ".".join(str(int(addr_hex[i:i + 2], 16)) for i in (6, 4, 2, 0))
            out[int(fields[9])] = f"{addr}:{int(port_hex, 16)}"
    return out


def _sockets_of(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _tree(root: int) -> list[int]:
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out += frontier
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_store_listens_on_its_host_only():
    from moerl.rendezvous import host_store

    store = host_store("127.0.0.1")
    mine = [addr for inode, addr in _listeners().items() if inode in _sockets_of(os.getpid())
            and addr.endswith(f":{store.port}")]
    assert mine == [f"127.0.0.1:{store.port}"], mine


@pytest.mark.timeout(240)
def test_a_local_run_requires_a_ray_token_and_binds_its_stores_to_loopback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    run = subprocess.Popen([sys.executable, "-m", "moerl.cli", "train", str(REPO / "configs" / "demo.toml"),
                            f"--run.dir={tmp_path}", "--train.steps=400", "--train.sft_steps=0",
                            "--rollout.num_workers=1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "metrics.jsonl").exists() or (tmp_path / "metrics.jsonl").stat().st_size < 1:
            assert run.poll() is None, run.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the run did not reach its first step"
            time.sleep(0.2)
        pids = _tree(run.pid)
        listeners = _listeners()
        open_to_network = {}  # "process title": [address] of listeners not on a loopback address
        for pid in pids:
            for inode in _sockets_of(pid) & set(listeners):
                addr = listeners[inode]
                if not addr.startswith(("127.", "::1")):
                    open_to_network.setdefault(_cmdline(pid)[:60], []).append(addr)
        print(open_to_network)
        # What listens beyond loopback is Ray's own servers (GCS, raylet, core workers), all behind the token...
        gcs = [p for p in pids if "gcs_server" in _cmdline(p)]
        assert gcs and b"RAY_AUTH_MODE=token" in Path(f"/proc/{gcs[0]}/environ").read_bytes().split(b"\0")
        # ... and the trainer's rendezvous store, which has no authentication, listens on loopback only.
        trainers = [p for p in pids if _cmdline(p).startswith("ray::TrainerRank")]
        assert trainers and any(listeners[i].startswith("127.") for i in _sockets_of(trainers[0]) & set(listeners))
        # gloo's pair listener sat on the host's IP, unauthenticated: a local run keeps it on loopback.
        environ = Path(f"/proc/{trainers[0]}/environ").read_bytes().split(b"\0")
        assert any(e.startswith(b"GLOO_SOCKET_IFNAME=lo") for e in environ)
    finally:
        run.terminate()
        try:
            run.wait(timeout=90)
        except subprocess.TimeoutExpired:
            run.kill()
