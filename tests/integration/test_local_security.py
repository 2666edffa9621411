"""The embedded default's network exposure: every listener of a local run (Ray's and moerl's) is on 127.0.0.1,
and its Ray requires a token of the run's own (moerl/local_ray.py). The test prints every listener of the run
by its owner. The same run then takes a Ctrl-C to its process group and saves (one run serves both)."""

from __future__ import annotations

import os
import signal
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


def _title(pid: int) -> str:
    """A process's title: its program's name (gcs_server, raylet) or the title Ray set (ray::TrainerRank)."""
    line = _cmdline(pid)
    program = line.split()[0].rsplit("/", 1)[-1] if line.strip() else ""
    return program if line.startswith("/") and not program.startswith("python") else line[:60]


def test_store_listens_on_its_host_only():
    from moerl.rendezvous import host_store

    store = host_store("127.0.0.1")
    mine = [addr for inode, addr in _listeners().items() if inode in _sockets_of(os.getpid())
            and addr.endswith(f":{store.port}")]
    assert mine == [f"127.0.0.1:{store.port}"], mine


@pytest.mark.timeout(240)
def test_a_local_run_listens_on_loopback_only_behind_its_own_token_and_ctrl_c_saves_it(tmp_path):
    """Every listening socket of the run (the CLI, Ray's GCS, raylet, agents and workers, the trainer's
    rendezvous store, gloo) is on a loopback address; Ray requires a token that only this run has, from a 0600
    file. (The trainer's store used to listen on the host's routed IP, Ray's servers on every interface, and Ray's
    token sat in ~/.ray/auth_token, 0644, shared by every run of the user.)

    Then Ctrl-C, as a terminal sends it: to every process of the foreground group (the run in its own session here),
    Ray's included (they ignore it): the run saves and exits 130 with the line that resumes it, never a
    KeyboardInterrupt traceback, and its token goes with it."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    home_token = Path.home() / ".ray" / "auth_token"
    before = home_token.stat().st_mtime_ns if home_token.exists() else None
    steps = 400  # never reached: the run is stopped at its first step
    run = subprocess.Popen([sys.executable, "-m", "moerl.cli", "train", str(REPO / "configs" / "demo.toml"),
                            f"--run.dir={tmp_path}", f"--train.steps={steps}", "--train.sft_steps=0",
                            "--train.batch_groups=2", "--rollout.group_size=4", "--rollout.num_workers=1",
                            "--checkpoint.every=0",  # only Ctrl-C's save
                            "--run.plots=false", "--run.tensorboard=false"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    token_dir = None
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "metrics.jsonl").exists() or (tmp_path / "metrics.jsonl").stat().st_size < 1:
            assert run.poll() is None, run.stdout.read()[-2000:]
            assert time.monotonic() < deadline, "the run did not reach its first step"
            time.sleep(0.2)
        pids = _tree(run.pid)
        listeners = _listeners()
        by_owner: dict[str, list[str]] = {}  # "pid process title": addresses it listens on
        for pid in pids:
            for inode in _sockets_of(pid) & set(listeners):
                by_owner.setdefault(f"{pid} {_title(pid)}", []).append(listeners[inode])
        print(by_owner)
        assert any("gcs_server" in owner for owner in by_owner) and any("TrainerRank" in o for o in by_owner)
        open_to_network = {owner: [a for a in addrs if not a.startswith(("127.", "::1"))]
                           for owner, addrs in by_owner.items()}
        assert not {o: a for o, a in open_to_network.items() if a}, open_to_network
        # gloo's pair listener sat on the host's IP, unauthenticated: a local run keeps it on loopback.
        trainers = [p for p in pids if _cmdline(p).startswith("ray::TrainerRank")]
        environ = Path(f"/proc/{trainers[0]}/environ").read_bytes().split(b"\0")
        assert any(e.startswith(b"GLOO_SOCKET_IFNAME=lo") for e in environ)
        # Ray's token: required, the run's own, in a 0600 file of a 0700 directory (not ~/.ray/auth_token).
        gcs = [p for p in pids if "gcs_server" in _cmdline(p)]
        gcs_env = dict(e.split(b"=", 1) for e in Path(f"/proc/{gcs[0]}/environ").read_bytes().split(b"\0") if b"=" in e)
        assert gcs_env[b"RAY_AUTH_MODE"] == b"token"
        token = Path(gcs_env[b"RAY_AUTH_TOKEN_PATH"].decode())
        token_dir = token.parent
        assert token.stat().st_mode & 0o777 == 0o600 and token_dir.stat().st_mode & 0o777 == 0o700
        # Ray's sessions (sockets, logs) inside that directory, not 0777 under /tmp/ray (issue 37 item 10)
        assert f"{token_dir / 'ray'}/session_" in _cmdline(gcs[0]), _cmdline(gcs[0])
        assert (home_token.stat().st_mtime_ns if home_token.exists() else None) == before
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=60)
    assert run.returncode == 130, out[-3000:]
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    line = next((x for x in out.splitlines() if x.startswith("stopped at step")), out[-2000:])
    assert line.startswith(f"stopped at step {int(latest.split('-')[1])} of {steps}; resume with: moerl train "), line
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert token_dir is not None and not token_dir.exists(), "the run's token outlived it"
