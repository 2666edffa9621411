"""What a launched pod runs (moerl.launch.node) and the TorchX components' contract with `torchx run`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from torchx.specs.file_linter import validate

from moerl.launch import components, node

ROOT = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_components_pass_the_torchx_linter() -> None:
    for fn in ("trainer", "rollout"):
        assert validate(components.__file__, fn) == []


def test_trainer_component_ships_the_resolved_config() -> None:
    app = components.trainer(str(ROOT / "configs" / "demo.toml"), overrides=["train.steps=3", "--run.name=x"])
    role = app.roles[0]
    assert app.name == "x-trainer" and role.entrypoint == sys.executable
    os.environ[node.CONFIG_ENV] = role.env[node.CONFIG_ENV]
    try:
        text = Path(node.config_path()).read_text()
    finally:
        del os.environ[node.CONFIG_ENV]
    assert "steps = 3" in text and 'name = "x"' in text
    with pytest.raises(ValueError, match="local"):
        components.trainer_app("", "x", nodes=2, mode="local")


def test_rollout_component_is_elastic_and_retried_per_replica() -> None:
    app = components.rollout("head:6379", image="img", nodes=4, min_nodes=2, gpus=8)
    role = app.roles[0]
    assert (role.name, role.num_replicas, role.min_replicas, role.retry_policy.value) == ("rollout", 4, 2, "REPLICA")
    assert role.args[role.args.index("--rollout-resource") + 1] == "8"
    assert components.rollout("h:1").roles[0].min_replicas is None


def test_procs_named_and_drain_forward_sigterm(tmp_path: Path) -> None:
    # A name of this test's own (drain signals every process whose title starts with it: the plain
    # `ray::RolloutWorker` would reach other runs' workers on this machine), and a ready file written once the trap
    # is set, so the signal never lands before it (that race failed the test now and then).
    name = f"ray::RolloutWorker-{uuid.uuid4().hex[:8]}"
    marker, ready = tmp_path / "got-term", tmp_path / "ready"
    script = f"trap 'touch {marker}; exit 0' TERM; touch {ready}; while true; do sleep 0.1; done"
    proc = subprocess.Popen(["bash", "-c", f'exec -a "{name}" bash -c "{script}"'])
    try:
        deadline = time.monotonic() + 30
        while not (ready.exists() and proc.pid in node.procs_named(name)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists() and proc.pid in node.procs_named(name)
        t0 = time.monotonic()
        node.drain(name, budget_s=120)
        # drain returns once its processes are gone, not at the end of its budget (a wide margin: no timing)
        assert proc.wait(timeout=30) == 0 and marker.exists() and time.monotonic() - t0 < 60
    finally:
        if proc.poll() is None:
            proc.kill()


def test_rollout_pod_without_a_head_exits_cleanly() -> None:
    t0 = time.monotonic()
    assert node.main(["rollout", "--head", f"127.0.0.1:{closed_port()}", "--wait-s", "1"]) == 0
    assert time.monotonic() - t0 < 10


def test_trainer_worker_without_a_head_fails() -> None:
    os.environ["MOERL_TEST_HEAD"] = "127.0.0.1"
    try:
        assert node.main(["trainer", "--rank", "1", "--port", str(closed_port()), "--head-env", "MOERL_TEST_HEAD",
                          "--wait-s", "1"]) == 1
    finally:
        del os.environ["MOERL_TEST_HEAD"]


def test_node_arguments() -> None:
    with pytest.raises(SystemExit):
        node.main(["rollout", "--head", "h:1", "--train.steps=2"])  # overrides are for the trainer only
    with pytest.raises(SystemExit):
        node.main(["train", "stray"])
    assert node._split("h", 6379) == ("h", 6379) and node._split("a.b:7", 6379) == ("a.b", 7)


def test_run_node_stops_on_sigterm_flag() -> None:
    class Fake:
        def __init__(self) -> None:
            self.stopped = False

        def alive(self) -> bool:
            return not self.stopped

        def stop(self) -> None:
            self.stopped = True

    stop, seen = threading.Event(), []
    stop.set()
    fake = Fake()
    assert node.run_node(fake, stop, ("127.0.0.1", closed_port()), 60, lambda: seen.append(1)) == "stopped"  # type: ignore[arg-type]
    assert fake.stopped and seen == [1]
    fake2, stop2 = Fake(), threading.Event()
    assert node.run_node(fake2, stop2, ("127.0.0.1", closed_port()), 0, None) == "head lost"  # type: ignore[arg-type]
    assert fake2.stopped


def test_a_trainer_rank_stays_up_for_the_shutdown_save_until_the_head_stops() -> None:
    """On a drain every pod gets SIGTERM at once; a rank > 0 keeps its Ray node while the head still answers
    (rank 0's shutdown save needs it), stops once the head is gone, and never past its linger budget."""
    class Fake:
        def __init__(self) -> None:
            self.stopped_at = 0.0

        def alive(self) -> bool:
            return not self.stopped_at

        def stop(self) -> None:
            self.stopped_at = time.monotonic()

    head = socket.socket()
    head.bind(("127.0.0.1", 0))
    head.listen(16)
    stop, fake = threading.Event(), Fake()
    stop.set()
    closed_at: list[float] = []

    def head_stops_later() -> None:
        time.sleep(2.0)
        closed_at.append(time.monotonic())
        head.close()

    threading.Thread(target=head_stops_later, daemon=True).start()
    assert node.run_node(fake, stop, head.getsockname(), 60, None, linger_s=30) == "stopped"  # type: ignore[arg-type]
    assert closed_at and closed_at[0] <= fake.stopped_at < closed_at[0] + 10
    with socket.socket() as up:  # a head that never stops: the linger budget ends it
        up.bind(("127.0.0.1", 0))
        up.listen(16)
        fake2, t0 = Fake(), time.monotonic()
        assert node.run_node(fake2, stop, up.getsockname(), 60, None, linger_s=1.5) == "stopped"  # type: ignore[arg-type]
        assert 1.0 <= fake2.stopped_at - t0 < 10


def test_sigterm_sets_the_stop_flag() -> None:
    stop = threading.Event()
    old = signal.getsignal(signal.SIGTERM)
    try:
        node._install_sigterm(stop)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(2)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_trainer_rank_joins_again_when_ray_start_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray start` gives up after 30 s when the GCS is busy with nodes joining at once: a rank > 0 whose node
    never started tries again (within --wait-s) instead of failing the trainer job."""
    class FakeNode:
        made: list[FakeNode] = []

        def __init__(self, *args: str, **kwargs: object) -> None:
            self.first = not FakeNode.made
            FakeNode.made.append(self)
            self.stopped = False

        def alive(self) -> bool:
            if not self.first and len(FakeNode.made) == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # the second one runs until the pod is stopped
            return not self.first and not self.stopped

        def failed_to_start(self) -> bool:
            return self.first

        proc = type("P", (), {"returncode": 1})()

        def stop(self) -> None:
            self.stopped = True

    monkeypatch.setattr(node, "RayNode", FakeNode)
    previous = signal.getsignal(signal.SIGTERM)
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen(16)
        try:
            assert node.main(["trainer", "--rank", "1", "--head", f"127.0.0.1:{head.getsockname()[1]}",
                              "--wait-s", "30", "--grace-s", "0"]) == node.STOPPED_BY_SIGTERM
        finally:
            signal.signal(signal.SIGTERM, previous)
    assert len(FakeNode.made) == 2 and FakeNode.made[1].stopped
