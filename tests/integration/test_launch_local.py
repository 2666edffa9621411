"""`moerl launch` end to end on this machine: the demo through TorchX's local_cwd scheduler, and the pod
entrypoints of the Kubernetes path (trainer rank 0 as the Ray head + controller, a rollout node joining it
with the `rollout` resource and leaving once the head is gone).

    PYTHONPATH=. RAY_AUTH_MODE=disabled python -m pytest tests/integration/test_launch_local.py -m integration

Ray runs with its own RAY_TMPDIR and explicit addresses, so another Ray on the machine is neither joined
nor stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.toml"
QUIET = ["--run.plots=false", "--run.tensorboard=false"]  # what these tests never look at: ~1 s a run
SHORT = ["--train.steps=2", "--train.sft_steps=2", "--train.batch_groups=2", "--rollout.group_size=4",
         "--rollout.num_workers=1", *QUIET]
pytestmark = pytest.mark.integration


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    ray_tmp = tempfile.mkdtemp(prefix="mr", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    yield {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmp}
    shutil.rmtree(ray_tmp, ignore_errors=True)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def wait_for_head(head: str, procs: dict[str, subprocess.Popen], timeout: float = 120) -> None:
    """Until the Ray head (trainer rank 0's) accepts connections: the rollout pod then joins it at once, and its
    short --wait-s only bounds how long it waits for a head once the trainer job is over."""
    import time

    host, port = head.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError:
            dead = next((k for k, p in procs.items() if p.poll() is not None), None)
            assert dead is None, f"{dead} exited ({procs[dead].poll()}): {procs[dead].communicate()[0][-3000:]}"
            assert time.monotonic() < deadline, f"no Ray head at {head} within {timeout} s"
            time.sleep(0.2)


# The rollout pod: joins the head, leaves once the head has been unreachable for 1 s (checked every 0.5 s), then
# waits 1 s for another head before it says the trainer job is over (exit 0).
ROLLOUT_WAIT = ["--wait-s", "1", "--lost-s", "1"]


@pytest.mark.timeout(150)
def test_local_cwd_launch_runs_the_demo(tmp_path: Path, env: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "moerl.cli", "launch", str(DEMO), "--scheduler", "local_cwd", *SHORT,
                          f"--run.dir={run_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=140, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "launched local_cwd://" in out.stdout and "SUCCEEDED" in out.stdout and "done: 2 steps" in out.stdout
    assert max(m["step"] for m in metrics(run_dir)) == 2


@pytest.mark.timeout(150)
def test_head_and_rollout_node_entrypoints(tmp_path: Path, env: dict[str, str]) -> None:
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    head = f"{ray.util.get_node_ip_address()}:{port}"
    run_dir, e = tmp_path / "run", env
    node = [sys.executable, "-m", "moerl.launch.node"]
    trainer = subprocess.Popen([*node, "trainer", "--rank", "0", "--nodes", "1", "--port", str(port), "--wait-s", "60",
                                "--config", str(DEMO), *SHORT, f"--run.dir={run_dir}"], env=e, cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rollout = None
    try:
        wait_for_head(head, {"trainer": trainer})
        rollout = subprocess.Popen([*node, "rollout", "--head", head, *ROLLOUT_WAIT], env=e,
                                   cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t_out, _ = trainer.communicate(timeout=120)
        r_out, _ = rollout.communicate(timeout=60)
    finally:
        for p in (trainer, rollout):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    assert trainer.returncode == 0, t_out[-3000:]
    assert "1/1 trainer nodes are up" in t_out and "done: 2 steps" in t_out
    assert rollout.returncode == 0, r_out[-3000:]
    assert "the trainer job is over" in r_out
    assert max(m["step"] for m in metrics(run_dir)) == 2


@pytest.mark.timeout(280)
def test_drain_sigterm_to_every_trainer_pod_still_saves(tmp_path: Path, env: dict[str, str]) -> None:
    """A drain sends SIGTERM to every pod at once. Trainer rank 1's node (holding trainer rank 1) must stay up
    until rank 0's shutdown save is done: three local Ray nodes (rank 0 = head + controller, rank 1, a rollout
    node, so the two trainer ranks land on the two trainer nodes), SIGTERM to both trainer pods mid-run, and the
    save commits with both ranks' state. The rollout pod leaves by itself once the head is gone (its SIGTERM
    drain, tests/unit/test_launch_node.py, would signal every `ray::RolloutWorker` on this machine)."""
    import signal
    import threading
    import time

    import ray

    from moerl.checkpoint import CheckpointStore

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    head = f"{ray.util.get_node_ip_address()}:{port}"
    run_dir, node = tmp_path / "run", [sys.executable, "-m", "moerl.launch.node"]
    lines: dict[str, list[str]] = {}
    readers: list[threading.Thread] = []

    def start(name: str, *args: str) -> None:  # its output read as it comes, so the test can wait on a line
        procs[name] = subprocess.Popen([*node, *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
        lines[name] = []
        readers.append(threading.Thread(target=lambda: lines[name].extend(procs[name].stdout), daemon=True))
        readers[-1].start()

    def wait_until(done, what: str, limit_s: float = 200) -> None:
        deadline = time.monotonic() + limit_s
        while not done():
            dead = next((k for k, p in procs.items() if p.poll() is not None), None)
            assert dead is None, f"{dead} exited ({procs[dead].poll()}): {''.join(lines[dead])[-3000:]}"
            assert time.monotonic() < deadline, f"{what} not within {limit_s} s"
            time.sleep(0.2)

    procs: dict[str, subprocess.Popen] = {}
    try:
        start("rank0", "trainer", "--rank", "0", "--nodes", "2", "--port", str(port), "--wait-s", "120", "--config",
              str(DEMO), "--train.steps=2000", "--train.sft_steps=0", "--train.num_ranks=2",
              "--rollout.num_workers=1", "--checkpoint.every=100000", "--train.batch_groups=2",
              "--rollout.group_size=4", *QUIET, f"--run.dir={run_dir}")
        wait_for_head(head, procs)
        # The rollout node joins before trainer rank 1's (so before rank 0's run starts): the ranks then keep to
        # the trainer nodes. Started together, the rollout node came after the trainer ranks were placed now and
        # then, and the test ran 15 s longer.
        start("rollout", "rollout", "--head", head, *ROLLOUT_WAIT)
        wait_until(lambda: any("Ray runtime started" in line for line in lines["rollout"]), "the rollout node up")
        start("rank1", "trainer", "--rank", "1", "--head", head, "--wait-s", "120", "--grace-s", "90")
        wait_until(lambda: (run_dir / "metrics.jsonl").exists() and any(m["step"] >= 2 for m in metrics(run_dir)),
                   "the run at step 2")
        for name in ("rank0", "rank1"):  # the drain: both trainer pods at once
            procs[name].send_signal(signal.SIGTERM)
        for name in ("rank0", "rank1"):
            procs[name].wait(timeout=150)
        procs["rollout"].wait(timeout=60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for reader in readers:  # each ends at its process's end of output
        reader.join(timeout=30)
    out = {name: "".join(got) for name, got in lines.items()}
    assert "stays up for rank 0's shutdown save" in out["rank1"], out["rank1"][-2000:]
    assert procs["rollout"].returncode == 0 and "the trainer job is over" in out["rollout"], out["rollout"][-2000:]
    store = CheckpointStore(str(run_dir / "checkpoints"))
    step = store.latest_step()
    assert step is not None and step >= 2, out["rank0"][-3000:]
    store.verify(step)  # both ranks' files, sizes and checksums
