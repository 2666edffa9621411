"""A full disk (issue 37 item 13): a run stopped with a bare `OSError: [Errno 28] No space left on device`, after five
raw matplotlib warnings with their source lines, and left zero-byte `.tmp` files. Now every write names its file,
the cause and what it lost, in one line; the plots' failures are one warning line of ours; no temporary is left."""

from __future__ import annotations

import errno
import io
import os
import warnings
from pathlib import Path

import pytest

from moerl.runlog.disk import DiskWriteError
from moerl.runlog.run_log import RunLog
from tests.unit.test_run_log import fake_run

FULL = OSError(errno.ENOSPC, "No space left on device")


class _FullFile:
    """A file on a full disk: every write fails (after writing nothing)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def write(self, data) -> int:
        raise FULL

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_full_disk_names_the_file_and_what_was_not_logged(tmp_path):
    log = RunLog(tmp_path, tensorboard=False)
    try:
        log._trajectories = _FullFile(log._trajectories)
        with pytest.raises(DiskWriteError) as e:
            log.log_trajectories([{"step": 16, "text": "x"}] * 64)
        assert str(e.value).startswith(f"writing {tmp_path / 'trajectories.jsonl'} failed: No space left on device "
                                       "(ENOSPC, ") and " MiB free there" in str(e.value)
        assert str(e.value).endswith(": 64 trajectories of step 16 were not logged") and e.value.errno == errno.ENOSPC
        log._metrics = _FullFile(log._metrics)
        with pytest.raises(DiskWriteError, match=r"metrics.jsonl failed: .*: step 17's metrics row was not logged$"):
            log.log_step(17, {"reward/mean": 0.5})
    finally:
        log._metrics, log._trajectories = log._metrics.inner, log._trajectories.inner
        log.close()


def test_no_zero_byte_temporary_is_left_by_a_failed_write(tmp_path, monkeypatch):
    """expert_load.json, the plots and a local checkpoint's COMMIT are written to a temporary and renamed: a full
    disk failed the write and left the empty temporary."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from moerl.checkpoint.storage import _write_durably
    from moerl.runlog.plots import write_plots

    fake_run(tmp_path)

    def full_savefig(self, path, **kwargs):
        Path(path).write_bytes(b"")
        raise FULL
    monkeypatch.setattr(Figure, "savefig", full_savefig)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert write_plots(tmp_path) == []
    said = [str(w.message) for w in caught]
    assert said == [f"plots reward.png, throughput.png, step_time.png, expert_load_rollout.png, "
                    f"expert_load_trainer.png not written in {tmp_path}: No space left on device (ENOSPC, "
                    + said[0].split("(ENOSPC, ", 1)[1]], said

    log = RunLog(tmp_path, tensorboard=False, resume=True)
    log.log_expert_load(1, "trainer", [[1, 2]])

    def full_write_text(self, text):
        self.touch()
        raise FULL
    monkeypatch.setattr(Path, "write_text", full_write_text)
    with pytest.raises(DiskWriteError, match="expert_load.json failed: No space left on device"):
        log.flush()
    monkeypatch.undo()
    log._expert_dirty = False
    log.close()

    def full_fsync(fd):
        raise FULL
    monkeypatch.setattr(os, "fsync", full_fsync)
    with pytest.raises(OSError):
        _write_durably(str(tmp_path / "ckpt" / "COMMIT"), b"{}")
    monkeypatch.undo()
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_the_plots_failures_are_a_warning_line_of_the_run_not_a_raw_warning(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from moerl.runlog.reporter import RunReporter

    def full_savefig(self, path, **kwargs):
        raise FULL
    monkeypatch.setattr(Figure, "savefig", full_savefig)
    stream = io.StringIO()
    report = RunReporter(tmp_path / "run", 2, stream=stream, tty=False, tensorboard=False, plot_every_s=3600)
    report.step(1, {"reward/mean": 0.5, "samples": 8.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reaches Python's warnings (printed raw, with a source line)
        report.close()
    lines = [line for line in stream.getvalue().splitlines() if "warning:" in line]
    assert len(lines) == 1 and "not written in" in lines[0] and "No space left on device (ENOSPC" in lines[0]
    assert "not written in" in (tmp_path / "run" / "error.log").read_text()


def test_moerl_train_names_the_file_and_the_checkpoint_to_resume_from(tmp_path, monkeypatch, capsys):
    from moerl import run, train_cli
    from moerl.checkpoint import CheckpointStore

    repo = Path(__file__).resolve().parents[2]
    store = CheckpointStore(str(tmp_path / "run" / "checkpoints"))
    store.write_bytes(12, "a.bin", b"a")
    store.commit(12)

    def full_disk(cfg, **kwargs):
        raise DiskWriteError(tmp_path / "run" / "metrics.jsonl", FULL, "step 16's metrics row was not logged")
    monkeypatch.setattr(run, "prepare", lambda cfg, **kw: run.Prepared(None, None, None))
    monkeypatch.setattr(run, "train", full_disk)
    assert train_cli.main([str(repo / "configs" / "demo.toml"), f"--run.dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: writing {tmp_path / 'run' / 'metrics.jsonl'} failed: No "
                                               "space left on device (ENOSPC")
    assert "step 16's metrics row was not logged; the newest checkpoint is step 12: resume with: " in err[0]
