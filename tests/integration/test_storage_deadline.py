"""Every storage call has a deadline (issue 26 item 4): an S3 endpoint that accepts connections and never answers
(a black hole on 127.0.0.1, started here) fails the start-up probe, `moerl export` and a save within
`checkpoint.storage_timeout_s`, each with one line naming the endpoint; the process exits; a save never blocks the
controller's thread. Only the deadlines are timed, with generous bounds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moerl.checkpoint import CheckpointError, CheckpointStore
from moerl.cli import main as cli
from tests.integration.test_checkpoint_s3 import save_step
from tests.unit.test_checkpoint_trainer import trained

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
ROOT = "s3://moerl-black-hole/run"


@pytest.fixture
def black_hole(monkeypatch):
    """AWS_ENDPOINT_URL -> a TCP server on 127.0.0.1 (a free port) that accepts and never answers."""
    s3fs = pytest.importorskip("s3fs")
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except (socket.timeout, OSError):
                continue
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    for var, value in (("AWS_ENDPOINT_URL", url), ("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "x" * 8),
                       ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_CONFIG_FILE", "/nonexistent"),
                       ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent"), ("AWS_EC2_METADATA_DISABLED", "true")):
        monkeypatch.setenv(var, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield url
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    server.close()
    s3fs.S3FileSystem.clear_instance_cache()


def test_the_probe_fails_within_its_deadline_and_moerl_train_exits(black_hole, tmp_path):
    """It printed its error at 71 s and never exited: the probe's thread was joined at exit."""
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        CheckpointStore(ROOT, timeout_s=2).probe()
    assert time.monotonic() - t0 < 30
    assert "did not answer within 2 s" in str(e.value) and black_hole in str(e.value) and "\n" not in str(e.value)
    cmd = [sys.executable, "-m", "moerl.cli", "train", "configs/demo.toml", f"--run.dir={tmp_path / 'run'}",
           f"--checkpoint.dir={ROOT}", "--checkpoint.storage_timeout_s=3"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=180)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and time.monotonic() - t0 < 120, proc.stderr
    assert err[-1].startswith(f"error: checkpoint.dir '{ROOT}': a test write did not answer within 3 s"), err
    assert black_hole in err[-1]


def test_export_fails_within_the_deadline_naming_the_endpoint(black_hole, tmp_path, capsys):
    """It printed nothing for 985 s."""
    t0 = time.monotonic()
    assert cli(["export", ROOT, str(tmp_path / "out"), "--timeout", "2"]) == 2
    assert time.monotonic() - t0 < 60
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not answer within 2 s" in err[0] and black_hole in err[0], err


def test_export_says_what_it_has_read_and_written(tmp_path, capsys):
    store = CheckpointStore(str(tmp_path / "ck"))
    save_step(store, trained(steps=1), 1)
    assert cli(["export", store.root, str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "export: read 7/7 files" in out and "export: verified 7 files" in out
    assert "export: reading the policy's tensors from 5 trainer files" in out
    assert "export: wrote" in out and "MiB of safetensors" in out


class _Uploaded:
    """A trainer group whose upload is done at once: what is left is the controller's own storage calls."""

    def save_state(self, path, use_async, target=None):
        pass

    def save_done(self):
        return []


def test_a_save_fails_within_the_deadline_without_blocking_the_controller(black_hole, capsys):
    """It froze the run at a save (synchronous S3 calls on the controller thread), and SIGTERM could not stop it."""
    from moerl.actors.checkpointer import Checkpointer
    from moerl.model import tiny_config

    ckpt = Checkpointer(ROOT, keep=2, arch=tiny_config(), fingerprint={}, storage_timeout_s=5, timeout_s=120)
    t0 = time.monotonic()
    ckpt.save(4, _Uploaded(), {"step": 4})
    assert time.monotonic() - t0 < 5  # returned before the first storage call could have timed out
    assert ckpt.poll() is None and ckpt.pending is not None  # the job is still waiting on the black hole
    assert ckpt.wait() is None
    assert time.monotonic() - t0 < 60
    out = capsys.readouterr().out
    assert "checkpoint step 4" in out and "did not answer within 5 s" in out and black_hole in out
    assert ckpt.failures == 1 and ckpt.latest() is None


def test_the_s3_client_alone_gives_up_within_the_deadline(black_hole):
    """Behind the caller's deadline, the call itself ends too (its thread is not left waiting ~30 minutes on
    botocore's and s3fs's retries): attempts x (connect + read timeout) fit the deadline, s3fs does not retry."""
    store = CheckpointStore(ROOT, timeout_s=4)
    config = store.fs.config_kwargs
    assert config["retries"]["max_attempts"] * (config["connect_timeout"] + config["read_timeout"]) <= 4
    assert store.fs.retries == 1
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - botocore's ReadTimeoutError or s3fs's wrapping of it
        store.fs.cat_file("moerl-black-hole/run/latest")  # no moerl deadline around it: the client's own
    assert time.monotonic() - t0 < 30
