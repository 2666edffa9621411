"""SIGTERM to the run's whole process group (Slurm's scancel, systemd's stop, `kill -- -PGID`) stops it like a
SIGTERM to the driver alone (issue 37 item 1): Ray's processes leave it to the driver, which saves (when it has
trained) and exits 143, releasing its locks. Before: the GCS and raylet died of it, and the run with them ("trainer
rank 0 died", "Failed to connect to GCS", a run that did not exit, `moerl.lock` left). The signal is sent at fixed
points of the run (after a line it prints, after a step it logged), not after a delay."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _start(run_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in (
        "RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([sys.executable, "-m", "moerl.cli", "train", str(REPO / "configs" / "demo.toml"),
                             f"--run.dir={run_dir}", "--train.steps=400", "--train.sft_steps=0",
                             "--rollout.num_workers=1", "--ray.num_cpus=2",
                             "--run.plots=false", "--run.tensorboard=false",
                             "--train.batch_groups=2", "--rollout.group_size=4"],  # a short step 1
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group, as `setsid moerl train` makes


def _read_until(proc: subprocess.Popen, done, what: str, lines: list[str], limit_s: float = 150.0) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        line = proc.stdout.readline()
        assert line or proc.poll() is None, f"the run ended before {what}:\n{''.join(lines)[-3000:]}"
        lines.append(line)
        assert time.monotonic() < deadline, f"no {what} within {limit_s:.0f} s"


def _logged_step(run_dir: Path) -> int:
    try:
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return 0
    return max((r.get("step", 0) for r in rows), default=0)


def _sigterm_deaf(pid: int) -> bool:
    """Whether SIGTERM is blocked or ignored in process `pid` (its SigBlk / SigIgn masks, bit 15 - 1)."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    bit = 1 << (signal.SIGTERM - 1)
    return bool((int(fields["SigBlk"], 16) | int(fields["SigIgn"], 16)) & bit)


def _run_processes(driver: int) -> dict[int, str]:
    """pid -> command line of every process under the driver (Ray's GCS, raylet, agents and the workers)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = {}, [driver]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        for p in frontier:
            try:
                out[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    return out


def _group_gone(pgid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(280)
@pytest.mark.parametrize("point", ["during trainer start-up", "after step 1"])
def test_sigterm_to_the_process_group_saves_and_exits_143(tmp_path, point):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    lines: list[str] = []
    try:
        if point == "during trainer start-up":
            _read_until(proc, lambda: lines and "starting 1 trainer rank" in lines[-1], "trainer start-up", lines)
        else:
            _read_until(proc, lambda: _logged_step(run_dir) >= 1, "step 1 in metrics.jsonl", lines)
            # Whether the save below wins its race with a dying GCS is timing; that every Ray process leaves the
            # signal to the driver is not: the GCS, raylet and trainer rank hold it (a rollout worker, in a process
            # group of its own, takes its own SIGTERM as a preemption notice).
            ray_processes = {p: c for p, c in _run_processes(proc.pid).items()
                             if "gcs_server" in c or "raylet" in c or c.startswith("ray::TrainerRank")}
            assert {"gcs", "raylet", "trainer"} <= {"gcs" if "gcs_server" in c else "raylet" if "raylet" in c
                                                    else "trainer" for c in ray_processes.values()}, ray_processes
            assert all(_sigterm_deaf(p) for p in ray_processes), ray_processes
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "".join(lines) + out
    assert proc.returncode == 143, text[-3000:]
    assert not (run_dir / "moerl.lock").exists() and not (run_dir / "checkpoints" / "moerl.lock").exists()
    assert _group_gone(proc.pid), "processes of the run outlived it"
    last = text.strip().splitlines()[-1]
    if point == "during trainer start-up":
        assert last.startswith("stopped before step 1 of 400: nothing to resume"), text[-3000:]
    else:
        from moerl.checkpoint import CheckpointStore

        saved = CheckpointStore(str(run_dir / "checkpoints")).latest_step()
        assert saved is not None and saved >= 1, text[-3000:]
        assert last.startswith(f"stopped at step {saved} of 400; resume with: ") and last.endswith("--resume"), last
