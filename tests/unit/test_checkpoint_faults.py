"""Storage faults: a checkpoint root that cannot be written is found before the run starts (named, with its
cause); a save that fails is counted and training goes on until `checkpoint.max_failures` in a row; a save whose
writers failed is never committed; a torn newest step or a forged file stops a resume with one line naming it
(issue 26 items 2, 8 and 10)."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from concurrent.futures import Future

import pytest

from moerl.actors.checkpointer import Checkpointer
from moerl.actors.pools import TrainerLost
from moerl.checkpoint import CheckpointStore
from moerl.config import load_config
from moerl.model import tiny_config
from moerl.model.config import CheckpointError


def test_probe_names_an_unwritable_root(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"checkpoint.dir '.*a-file/ckpts' is not writable: \w+"):
        CheckpointStore(str(blocker / "ckpts")).probe()
    store = CheckpointStore(str(tmp_path / "ok"))
    store.probe()  # writes and deletes its probe object
    assert list((tmp_path / "ok").iterdir()) == []


def test_train_refuses_an_unwritable_checkpoint_dir_before_ray_starts(tmp_path):
    import ray

    from moerl.run import train

    (tmp_path / "a-file").write_text("")
    cfg = load_config("configs/demo.toml", [f"--run.dir={tmp_path / 'run'}",
                                            f"--checkpoint.dir={tmp_path / 'a-file' / 'ckpts'}"])
    with pytest.raises(CheckpointError, match="is not writable"):
        train(cfg)
    assert not ray.is_initialized()


class _FullDisk:
    """A trainer group whose saves fail like a full disk."""

    def save_state(self, path, use_async, target=None):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_failed_saves_keep_training_until_max_failures(tmp_path, capsys):
    ckpt = Checkpointer(str(tmp_path / "ckpts"), keep=2, arch=tiny_config(), fingerprint={}, max_failures=3)
    for step in (2, 4):
        ckpt.save(step, _FullDisk(), {"step": step})
        assert ckpt.pending is None and ckpt.failures == step // 2
    out = capsys.readouterr().out
    assert "checkpoint step 4" in out and "No space left on device" in out and "MiB free there" in out
    assert "training goes on" in out
    with pytest.raises(CheckpointError, match=r"3 saves in a row failed \(checkpoint.max_failures\)"):
        ckpt.save(6, _FullDisk(), {"step": 6})
    assert ckpt.store.committed_steps() == []


# ------------------------------------------------------------------------------------------ a save that fails
def _writer_threads_fail(monkeypatch, after: int = 64) -> list[str]:
    """ENOSPC inside DCP's extra writer threads only (whose errors DCP drops), after `after` bytes of a file."""
    from fsspec.implementations.local import LocalFileOpener

    real, failed = LocalFileOpener.write, []

    def write(self, data):
        if "_write_files_from_queue" in threading.current_thread().name and self.path.endswith(".distcp"):
            real(self, memoryview(data)[:after])
            failed.append(self.path)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)
    monkeypatch.setattr(LocalFileOpener, "write", write)
    return failed


@pytest.mark.parametrize("use_async", [False, True])
def test_a_disk_that_fills_mid_save_commits_nothing_and_latest_stays(tmp_path, monkeypatch, capsys, use_async):
    """Issue 26 item 2: step 20 was committed with 2 of its 4 shard files (DCP's writer threads drop their
    errors); resume and export then died on a KeyError."""
    from moerl.actors import checkpointer
    from tests.unit.test_checkpoint_trainer import _InProcessGroup, futures_as_ray_refs, trained

    futures_as_ray_refs(monkeypatch)
    tr = trained(steps=1, bias_rate=0.0)
    ckpt = checkpointer.Checkpointer(str(tmp_path / "ckpts"), keep=1, arch=tr.model.config, fingerprint={},
                                     use_async=use_async)
    ckpt.save(10, _InProcessGroup(tr), {"step": 10})
    ckpt.wait()
    assert ckpt.latest() == 10
    failed = _writer_threads_fail(monkeypatch)
    ckpt.save(20, _InProcessGroup(tr), {"step": 20})
    ckpt.wait()
    assert failed, "no writer thread wrote a shard"
    out = capsys.readouterr().out
    assert "checkpoint step 20" in out and "No space left on device" in out and "training goes on" in out
    assert ckpt.failures == 1 and ckpt.latest() == 10
    assert ckpt.store.committed_steps() == [10] and ckpt.store.latest_step() == 10
    assert not (tmp_path / "ckpts" / "step-00000020" / "COMMIT").exists()
    ckpt.store.verify(10)


def _hole(tmp_path, commit_it: bool):
    """Step 1 whole and step 2 whose trainer files lose one shard and have another cut short after the save."""
    from moerl.checkpoint import save_trainer_state, write_arch
    from tests.unit.test_checkpoint_trainer import reseal, trained

    store = CheckpointStore(str(tmp_path / "ckpts"))
    tr = trained(steps=1, bias_rate=0.0)
    for step in (1, 2):
        store.begin(step)
        sums = save_trainer_state(tr, f"{store.step_path(step)}/trainer", use_async=False).result()
        write_arch(store, step, tr.model.config)
        if step == 1 or commit_it:
            store.commit(step, checksums={f"trainer/{k}": v for k, v in sums.items()})
    trainer = tmp_path / "ckpts" / "step-00000002" / "trainer"
    (trainer / "__0_1.distcp").unlink()
    cut = trainer / "__0_2.distcp"
    cut.write_bytes(cut.read_bytes()[:100])
    if commit_it:
        reseal(store, 2)  # as an older moerl committed it: sizes of what was there
    return store


def test_commit_refuses_trainer_files_that_lack_bytes_their_metadata_names(tmp_path):
    store = _hole(tmp_path, commit_it=False)
    with pytest.raises(CheckpointError) as e:
        store.commit(2)
    assert "missing __0_1.distcp" in str(e.value) and "__0_2.distcp has 100 bytes, its entries need" in str(e.value)
    assert store.committed_steps() == [1] and store.latest_step() == 1


def test_a_step_committed_with_a_hole_is_torn_and_never_outlives_the_intact_one(tmp_path):
    """A step an older moerl committed with missing shards: resume names the intact step, pruning keeps it."""
    from moerl import preflight
    from moerl.preflight import PreflightError

    store = _hole(tmp_path, commit_it=True)
    assert store.committed_steps() == [1, 2] and store.latest_step() == 2
    with pytest.raises(PreflightError) as e:
        preflight.check_resume(store, {}, every=1)
    assert str(e.value).startswith("--resume: checkpoint step 2 is torn (") and "missing __0_1.distcp" in str(e.value)
    assert str(e.value).endswith("the newest intact step is 1: resume from it with --resume-step=1")
    assert store.prune(keep=1) == [] and store.committed_steps() == [1, 2]  # step 1 is the newest loadable


def test_commit_and_latest_are_fsynced_before_they_count(tmp_path, monkeypatch):
    """A COMMIT renamed into place without fsync could be lost in a power cut after `latest` named its step."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    store = CheckpointStore(str(tmp_path / "ckpts"))
    store.write_bytes(3, "a.bin", b"a")
    synced.clear()
    store.commit(3)
    step, root = str(tmp_path / "ckpts" / "step-00000003"), str(tmp_path / "ckpts")
    at = 0
    for path in (f"{step}/COMMIT.tmp", step, f"{root}/latest.tmp", root):  # file, then its directory, in order
        at = synced.index(path, at) + 1


# ------------------------------------------------------------------------------------------ a torn newest step
@pytest.mark.parametrize("damage", [b"", b'{"step": 3, "fi', None])
def test_resume_refuses_a_torn_newest_step_and_names_the_intact_one(tmp_path, damage):
    """Issue 26 item 8: a damaged COMMIT made resume fall back silently to step 2 (and later overwrite step 3)."""
    from moerl import preflight
    from moerl.preflight import PreflightError

    store = CheckpointStore(str(tmp_path / "ck"))
    for step in (1, 2, 3):
        store.write_bytes(step, "controller.pt", b"state %d" % step)
        store.commit(step, {"fingerprint": {}})
    commit = tmp_path / "ck" / "step-00000003" / "COMMIT"
    if damage is None:
        commit.unlink()  # lost: `latest` still names step 3
    else:
        commit.write_bytes(damage)
    with pytest.raises(PreflightError) as e:
        preflight.check_resume(store, {}, every=1)
    text = str(e.value)
    assert "\n" not in text and text.startswith("--resume: checkpoint step 3 is torn (")
    assert ("`latest` names it but it has no COMMIT" if damage is None else "COMMIT: not valid JSON") in text
    assert text.endswith("the newest intact step is 2: resume from it with --resume-step=2")
    assert preflight.check_resume(store, {}, every=1, step=2) == 2
    with pytest.raises(CheckpointError, match=r"step 3 is torn .*--step 2"):
        from moerl.checkpoint import export_policy

        export_policy(store.root, str(tmp_path / "hf"))
    store.write_bytes(4, "controller.pt", b"half")  # an upload cut short after step 3: not torn, not a reason to refuse
    assert [s for s, _ in store.torn_steps(2)] == [3]


def test_moerl_train_resume_of_a_torn_newest_step_overwrites_nothing(tmp_path, capsys):
    from moerl.train_cli import main

    run_dir, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    store = CheckpointStore(str(ck))
    for step in (1, 2):
        store.write_bytes(step, "controller.pt", b"state %d" % step)
        store.commit(step, {"fingerprint": {}})
    (ck / "step-00000002" / "COMMIT").write_bytes(b"")
    rows = "".join(json.dumps({"step": s, "time": float(s)}) + "\n" for s in range(1, 4))
    (run_dir / "metrics.jsonl").write_text(rows)
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    assert main(["configs/demo.toml", f"--run.dir={run_dir}", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint step 2 is torn" in err[0] and "--resume-step=1" in err[0], err
    assert (run_dir / "metrics.jsonl").read_text() == rows
    assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------------------------------ forged files on resume
def _evil_torch_file(size: int = 0) -> bytes:
    """A torch.save zip whose pickle calls os.system: refused by weights_only=True, with torch's advice to set
    weights_only=False, which must never reach the user. size: padded to exactly that many bytes (zip comment)."""
    import io
    import pickle
    import zipfile

    import torch

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)

    def build(comment: bytes) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z, zipfile.ZipFile(out, "w") as w:
            for name in z.namelist():
                w.writestr(name, pickle.dumps(Evil()) if name.endswith("data.pkl") else z.read(name))
            w.comment = comment
        return out.getvalue()
    data = build(b"")
    return build(b"x" * (size - len(data))) if size else data


def _forge_a_tensor(trainer_dir) -> str:
    """Overwrite one tensor's stored bytes (same offset, same length) with the payload; its file's name."""
    from moerl.checkpoint.trainer_state import _MetadataUnpickler

    with open(trainer_dir / ".metadata", "rb") as f:
        meta = _MetadataUnpickler(f).load()
    size = len(_evil_torch_file())
    info = min((i for i in meta.storage_data.values() if 0 <= i.length - size <= 60000), key=lambda i: i.length)
    path = trainer_dir / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset:info.offset + info.length] = _evil_torch_file(info.length)
    path.write_bytes(bytes(data))
    return info.relative_path


@pytest.mark.parametrize("victim", ["controller.pt", "trainer"])
def test_a_forged_file_on_resume_is_one_line_naming_it(tmp_path, victim):
    from tests.unit.test_checkpoint_trainer import _committed, _LocalTrainer, make_trainer, reseal

    _, ckpt, _ = _committed(tmp_path)
    step = tmp_path / "ckpts" / "step-00000001"
    if victim == "trainer":
        victim = _forge_a_tensor(step / "trainer")
    else:
        (step / victim).write_bytes(_evil_torch_file())
    reseal(ckpt.store, 1)
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(_LocalTrainer(make_trainer(bias_rate=0.0)))
    text = str(e.value)
    assert "\n" not in text and victim in text and "weights_only" not in text, text
    assert "not plain tensor data" in text and "refused" in text, text


def test_a_trainer_ranks_checkpoint_error_comes_back_as_its_own_line(tmp_path):
    import ray

    from tests.unit.test_checkpoint_trainer import _committed

    _, ckpt, _ = _committed(tmp_path)

    class Rank:
        def load_state(self, path, timeout_s=60.0):
            cause = CheckpointError(f"{path}/.metadata: entry 'x' is a BytesStorageMetadata, not a tensor")
            raise ray.exceptions.RayTaskError("TrainerRank.load_state", "Traceback (most recent call last):\n  ...",
                                              cause)
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(Rank())
    assert str(e.value).endswith(".metadata: entry 'x' is a BytesStorageMetadata, not a tensor")


def test_close_ends_the_save_jobs_ray_calls_before_ray_shuts_down(tmp_path, monkeypatch):
    """train() calls close() before ray.shutdown(): a save still waiting for its uploads makes no Ray call after
    it (one racing the shutdown meets a destroyed core worker, and Ray ends the whole process with _exit(1)), and
    that step stays uncommitted."""
    from moerl.actors import checkpointer
    from tests.unit.test_checkpoint_trainer import wait_futures

    calls: list[str] = []
    monkeypatch.setattr(checkpointer, "_RAY_SLICE_S", 0.05)
    monkeypatch.setattr(checkpointer.ray, "wait", lambda *a, **k: calls.append("wait") or wait_futures(*a, **k))
    monkeypatch.setattr(checkpointer.ray, "get", lambda refs, timeout=None: calls.append("get") or [{}])
    upload = Future()  # never finishes

    class Uploading:
        def save_state(self, path, use_async, target=None):
            pass

        def save_done(self):
            return [upload]

    events: list[tuple[str, str]] = []
    ckpt = Checkpointer(str(tmp_path / "ckpts"), keep=2, arch=tiny_config(), fingerprint={}, timeout_s=120,
                        on_event=lambda kind, text: events.append((kind, text)))
    ckpt.save(4, Uploading(), {"step": 4})
    deadline = time.monotonic() + 30
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    ckpt.close()
    seen = len(calls)
    job = ckpt.pending[1]
    job.exception(timeout=30)  # the job ends at once, not after timeout_s
    assert len(calls) == seen and "get" not in calls
    ckpt.wait()
    assert events[-1][0] == "warning" and "the run ended before the trainer's uploads finished" in events[-1][1]
    assert ckpt.store.latest_step() is None


@pytest.mark.parametrize("cause, needles", [
    (OSError(f"/ckpt/step-00000004/trainer: OSError: writing __0_0.distcp failed: OSError: [Errno {errno.ENOSPC}] "
             "No space left on device"), ("/ckpt/step-00000004/trainer", "No space left on device")),
    (OSError("s3://bucket/run/step-00000004/trainer: StorageTimeout: write did not answer within 60 s (S3 endpoint "
             "http://127.0.0.1:9/; checkpoint.storage_timeout_s bounds each storage call)"),
     ("did not answer within 60 s", "S3 endpoint http://127.0.0.1:9/")),
])
def test_a_failed_save_names_the_ranks_own_cause_not_rays_wrapper(tmp_path, monkeypatch, capsys, cause, needles):
    """The line read `RayTaskError(OSError): ray::TrainerRank.wait_save() (pid=..., actor_id=...)` (issue 37
    item 3): the path and ENOSPC, or the endpoint of an S3 deadline, were in neither it nor error.log."""
    import ray

    from moerl.actors import checkpointer

    wrapped = ray.exceptions.RayTaskError("TrainerRank.wait_save", "Traceback (most recent call last): ...",
                                          cause).as_instanceof_cause()

    class _FailingUpload:
        def save_state(self, path, use_async, target=None):
            pass

        def save_done(self):
            failed = Future()
            failed.set_exception(wrapped)
            return [failed]
    monkeypatch.setattr(checkpointer.ray, "wait", lambda refs, num_returns=1, timeout=None: (refs, []))
    monkeypatch.setattr(checkpointer.ray, "get", lambda refs, timeout=None: [f.result() for f in refs])
    events = []
    ckpt = Checkpointer(str(tmp_path / "ckpts"), keep=2, arch=tiny_config(), fingerprint={}, use_async=False,
                        on_event=lambda kind, text: events.append((kind, text)))
    ckpt.save(4, _FailingUpload(), {"step": 4})
    (kind, text), = events
    assert kind == "warning" and text.startswith(f"checkpoint step 4 to {tmp_path / 'ckpts'}/step-00000004 failed: "
                                                 "OSError: ")
    assert all(n in text for n in needles), text
    assert "ray::" not in text and "actor_id" not in text and "RayTaskError" not in text


def test_a_rank_that_dies_during_a_save_ends_the_run_naming_it(tmp_path, monkeypatch):
    """A trainer rank killed while its save uploads: the save job's wait saw the death first and the run ended with
    a raw ActorDiedError (CI caught it), not the rank's line that run.py adds the checkpoint to resume from."""
    import ray

    from moerl.actors import checkpointer

    def upload(error=None):
        f = Future()
        f.set_exception(error) if error else f.set_result({})
        return f

    class _RankOneDies:
        def save_state(self, path, use_async, target=None):
            pass

        def save_done(self):
            return [upload(), upload(ray.exceptions.ActorDiedError())]

    def get(refs, timeout=None):
        return [f.result() for f in refs] if isinstance(refs, list) else refs.result()
    monkeypatch.setattr(checkpointer.ray, "wait", lambda refs, num_returns=1, timeout=None: (refs, []))
    monkeypatch.setattr(checkpointer.ray, "get", get)
    ckpt = Checkpointer(str(tmp_path / "ckpts"), keep=2, arch=tiny_config(), fingerprint={}, use_async=False)
    with pytest.raises(TrainerLost, match=r"^trainer rank 1 died during a checkpoint save \("):
        ckpt.save(4, _RankOneDies(), {"step": 4})
    assert ckpt.store.latest_step() is None
