"""Checkpoints against a real S3 API: moto's S3 server on 127.0.0.1 (a free port), reached through s3fs with the
endpoint from AWS_ENDPOINT_URL, as any S3-compatible store would be. No client is mocked. The store tests run on
S3 and on a local directory alike.

    PYTHONPATH=. RAY_AUTH_MODE=disabled python -m pytest tests/integration/test_checkpoint_s3.py
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moerl.checkpoint import (
    CheckpointError, CheckpointStore, export_policy, load_trainer_state, save_trainer_state, write_arch,
)
from moerl.model import load_pretrained
from tests.distributed.dist_harness import run_ranks
from tests.unit.test_checkpoint_trainer import assert_same, make_trainer, snapshot, train_step, trained

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
BUCKET = "moerl-ckpt-test"
SECRET = "s3cr3t-MUST-NOT-LEAK"


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def s3_endpoint():
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    s3fs = pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()  # port=0: the OS picked a free one
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(var, raising=False)
        mp.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", "/nonexistent")  # never a developer's real profile
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        s3fs.S3FileSystem.clear_instance_cache()  # a cached client may point at another endpoint
        yield f"http://{host}:{port}"
        s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


@pytest.fixture
def s3_root(s3_endpoint) -> str:
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> str:
    return str(tmp_path / "ckpts") if request.param == "local" else request.getfixturevalue("s3_root")


def save_step(store: CheckpointStore, trainer, step: int, *, use_async: bool = False) -> None:
    store.begin(step)
    fut = save_trainer_state(trainer, f"{store.step_path(step)}/trainer", use_async=use_async)
    store.write_bytes(step, "controller.pt", b"controller state")
    write_arch(store, step, trainer.model.config)
    if fut is not None:
        fut.result()
    store.commit(step, {"fingerprint": {"model.preset": "tiny"}})


# ------------------------------------------------------------------------------------------ the store
def test_commit_latest_prune_verify(root):
    store = CheckpointStore(root)
    assert store.latest_step() is None and store.committed_steps() == []
    for step in (2, 4, 6):
        store.write_bytes(step, "a.bin", b"x" * step)
        store.write_bytes(step, "sub/b.bin", b"yy")
        manifest = store.commit(step, {"fingerprint": {"lr": 1e-3}})
        assert manifest["files"] == {"a.bin": step, "sub/b.bin": 2} and manifest["fingerprint"] == {"lr": 1e-3}
    assert store.committed_steps() == [2, 4, 6] and store.latest_step() == 6
    assert store.read_manifest(4)["step"] == 4 and store.verify(6)["files"]["a.bin"] == 6
    assert store.fs.cat_file(f"{root.removeprefix('s3://')}/latest".lstrip()) == b"step-00000006"
    assert store.prune(keep=2) == [2]
    assert store.committed_steps() == [4, 6] and store.read_bytes(6, "sub/b.bin") == b"yy"
    with pytest.raises(CheckpointError, match=r"step-00000002: not committed"):
        store.verify(2)
    with pytest.raises(ValueError, match="reserved"):
        store.commit(6, {"files": {}})


def test_crash_during_upload_leaves_previous_checkpoint_latest_and_loadable(root):
    store = CheckpointStore(root)
    tr = trained(steps=1)
    ref = snapshot(tr)
    save_step(store, tr, 1)
    train_step(tr, 1)
    store.begin(2)  # the crash: step 2's shard is uploaded, its .metadata and COMMIT never are
    save_trainer_state(tr, f"{store.step_path(2)}/trainer", use_async=False)
    store.fs.rm_file(f"{store.step_path(2)}/trainer/.metadata")
    store.write_bytes(2, "controller.pt", b"half")
    assert store.latest_step() == 1 and store.committed_steps() == [1]
    fresh = make_trainer(seed=3)
    load_trainer_state(fresh, f"{store.step_path(store.latest_step())}/trainer")
    assert_same(snapshot(fresh), ref)
    with pytest.raises(CheckpointError, match="step-00000002: not committed"):
        store.verify(2)
    assert store.prune(keep=1) == []  # step 2 may still be uploading: newer than the newest committed
    save_step(store, tr, 3)
    assert store.prune(keep=1) == [1, 2]  # the abandoned upload goes with the old step
    assert store.committed_steps() == [3] and not store.fs.exists(store.step_path(2))


def test_partial_checkpoint_names_what_is_missing(root):
    store = CheckpointStore(root)
    save_step(store, trained(steps=1), 5)
    shard = f"{store.step_path(5)}/trainer/__0_0.distcp"
    store.fs.rm_file(shard)
    store.fs.pipe_file(f"{store.step_path(5)}/arch.json", b"{}")  # truncated: another size than the manifest
    with pytest.raises(CheckpointError) as e:
        store.verify(5)
    assert "missing trainer/__0_0.distcp" in str(e.value) and "arch.json has 2 bytes, the manifest says" in str(e.value)
    assert SECRET not in str(e.value)
    with pytest.raises(CheckpointError, match=r"step-00000005: incomplete checkpoint: .*__0_0\.distcp"):
        export_policy(root, "/nonexistent/out")


def test_corrupted_latest_falls_back_to_highest_committed(root):
    store = CheckpointStore(root)
    for step in (1, 2):
        store.write_bytes(step, "f", b"1")
        store.commit(step)
    store.write_bytes(3, "f", b"1")  # uncommitted
    latest = f"{store.step_path(0).rsplit('/', 1)[0]}/latest"
    for text in (b"\x00garbage", b"step-00000003", b"step-00000009", b""):
        store.fs.pipe_file(latest, text)
        assert store.latest_step() == 2, text
    store.fs.rm_file(latest)
    assert store.latest_step() == 2
    store.fs.pipe_file(latest, b"step-00000001\n")  # names an older committed step: that one is resumed
    assert store.latest_step() == 1
    assert store.prune(keep=1) == []  # never the step `latest` names
    store.fs.pipe_file(f"{store.step_path(2)}/COMMIT", b"{not json")
    assert store.committed_steps() == [1]


# ------------------------------------------------------------------------------------------ trainer on S3
def test_async_save_to_s3_then_load_equals_sync(s3_root, tmp_path):
    store = CheckpointStore(s3_root)
    tr = trained(steps=2)
    ref = snapshot(tr)
    save_step(store, tr, 1)
    store.begin(2)
    fut = save_trainer_state(tr, f"{store.step_path(2)}/trainer", use_async=True)
    train_step(tr, 7)  # trains while the upload runs
    fut.result()
    store.commit(2)
    for step in (1, 2):
        fresh = make_trainer(seed=11)
        load_trainer_state(fresh, f"{store.step_path(step)}/trainer")
        assert_same(snapshot(fresh), ref)
    out = export_policy(s3_root, str(tmp_path / "hf"), step=1)
    exported = load_pretrained(out)
    for name, t in exported.state_dict().items():
        if not name.endswith("expert_bias"):
            assert torch.equal(t, ref[f"model/{name}"]), name


_KILLED_MID_UPLOAD = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import torch.distributed.checkpoint._fsspec_filesystem as fsspec_fs
from moerl.checkpoint import CheckpointStore, save_trainer_state
from tests.unit.test_checkpoint_trainer import trained

def die(self, *args, **kwargs):  # DCP's last act is writing .metadata: the shard is uploaded, then SIGKILL
    os.kill(os.getpid(), signal.SIGKILL)

fsspec_fs.FsspecWriter.finish = die
store = CheckpointStore({root!r})
store.begin(2)
save_trainer_state(trained(steps=3), store.step_path(2) + "/trainer", use_async=True).result()
"""


def test_sigkill_mid_upload_keeps_previous_checkpoint(s3_root):
    store = CheckpointStore(s3_root)
    tr = trained(steps=1)
    ref = snapshot(tr)
    save_step(store, tr, 1)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED_MID_UPLOAD.format(repo=str(REPO), root=s3_root))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert store.fs.exists(f"{store.step_path(2)}/trainer/__0_0.distcp")  # it died mid-save, not before
    assert store.latest_step() == 1 and store.committed_steps() == [1]
    fresh = make_trainer(seed=2)
    load_trainer_state(fresh, f"{store.step_path(1)}/trainer")
    assert_same(snapshot(fresh), ref)


# ------------------------------------------------------------------------------------------ 2 ranks, EP, S3
def _two_ranks_expert_parallel(rank: int, world: int, root: str, out_dir: str) -> None:
    torch.manual_seed(100 + rank)  # each rank's RNG differs: the checkpoint must keep both
    group = dist.group.WORLD
    tr = make_trainer(group=group, ep=True)
    store = CheckpointStore(root)
    train_step(tr, 1, rank)
    if rank == 0:
        store.begin(1)
    dist.barrier()
    save_trainer_state(tr, f"{store.step_path(1)}/trainer", use_async=False)
    ref1 = snapshot(tr)
    train_step(tr, 2, rank)
    if rank == 0:
        store.begin(2)
    dist.barrier()
    fut = save_trainer_state(tr, f"{store.step_path(2)}/trainer", use_async=True)
    ref2 = snapshot(tr)
    train_step(tr, 3, rank)  # collectives on the training group while the upload's run on the checkpoint group
    fut.result()
    torch.save({k: v for k, v in ref2.items() if k.startswith("model/")}, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        write_arch(store, 1, tr.model.config)
        write_arch(store, 2, tr.model.config)
        store.commit(1)
        store.commit(2)
    dist.barrier()
    for step, ref in ((2, ref2), (1, ref1)):
        fresh = make_trainer(seed=9, group=group, ep=True)
        load_trainer_state(fresh, f"{store.step_path(step)}/trainer")
        assert_same(snapshot(fresh), ref)
    assert any(k.endswith(f".experts.down_proj@ep{rank}of2") for k in ref2)


@pytest.mark.distributed
def test_two_ranks_expert_parallel_round_trip_and_export(s3_root, tmp_path):
    run_ranks(2, _two_ranks_expert_parallel, s3_root, str(tmp_path), timeout=180)
    store = CheckpointStore(s3_root)
    assert store.latest_step() == 2
    with pytest.raises(CheckpointError, match="saved with expert-parallel size 2, this trainer has 1"):
        load_trainer_state(make_trainer(), f"{store.step_path(2)}/trainer")
    exported = load_pretrained(export_policy(s3_root, str(tmp_path / "hf")))
    shards = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, t in exported.state_dict().items():
        if name.endswith("expert_bias"):
            continue
        if ".experts." in name:
            want = torch.cat([shards[r][f"model/{name}@ep{r}of2"] for r in range(2)])
        else:
            want = shards[0][f"model/{name}"]
        assert torch.equal(t, want), name
