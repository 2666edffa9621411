"""Storage faults: a checkpoint root that cannot be written is found before the run starts (named, with its
cause); a save that fails is counted and training goes on until `checkpoint.max_failures` in a row."""

from __future__ import annotations

import errno

import pytest

from moerl.actors.checkpointer import Checkpointer
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

    def save_state(self, path, use_async):
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
