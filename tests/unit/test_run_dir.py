"""A run directory has one owner (issue 27 item 6): a second run is refused naming the holder's pid and host; a lock
left by a crashed run (its pid gone on this host) is taken over; the lock goes when the run ends, however it ends."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moerl.preflight import PreflightError
from moerl.run_dir import LOCK_FILE, RunLock

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.toml")


def test_a_second_run_is_refused_naming_the_holder(tmp_path) -> None:
    with RunLock(tmp_path) as first:
        assert first.took_over is None
        held = json.loads((tmp_path / LOCK_FILE).read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
        with pytest.raises(PreflightError) as e:
            RunLock(tmp_path).acquire()
        text = str(e.value)
        assert text.startswith(f"run.dir '{tmp_path}' is in use by another run: pid {os.getpid()} on "
                               f"{socket.gethostname()}") and "\n" not in text, text
    assert not (tmp_path / LOCK_FILE).exists()  # released: the next run takes it
    RunLock(tmp_path).acquire().release()


def test_a_run_in_another_process_holds_it_until_it_exits(tmp_path) -> None:
    code = (f"import sys, time; from moerl.run_dir import RunLock; lock = RunLock({str(tmp_path)!r}).acquire(); "
            "print('held', flush=True); sys.stdin.readline()")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(PreflightError, match=f"in use by another run: pid {holder.pid} on "):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()  # a crash: the lock file stays behind
        holder.wait(timeout=30)
    assert (tmp_path / LOCK_FILE).exists()
    lock = RunLock(tmp_path).acquire()
    assert lock.took_over is not None and f"pid {holder.pid}" in lock.took_over and "no longer runs" in lock.took_over
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_stale_or_foreign_lock_file(tmp_path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    record = {"pid": int(gone.stdout), "host": socket.gethostname(), "started": "2026-01-01T00:00:00Z"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(record))  # a crash that left its lock behind
    lock = RunLock(tmp_path).acquire()
    assert "no longer runs" in lock.took_over
    lock.release()
    (tmp_path / LOCK_FILE).write_text("")  # cut short while being written: nobody holds it
    RunLock(tmp_path).acquire().release()
    (tmp_path / LOCK_FILE).write_text(json.dumps({**record, "host": "elsewhere-7"}))
    with pytest.raises(PreflightError, match=r"pid \d+ on elsewhere-7 .*cannot tell from here.*delete "):
        RunLock(tmp_path).acquire()


def test_moerl_train_refuses_a_locked_run_dir_before_ray(tmp_path, capsys, monkeypatch) -> None:
    from moerl import run, train_cli

    monkeypatch.setattr(run, "train", lambda cfg, **kw: {"stopped": None, "step": 1, "steps": 1, "metrics": {},
                                                        "counters": {}, "checkpoint_step": 1})
    with RunLock(tmp_path / "run"):
        assert train_cli.main([DEMO, f"--run.dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: run.dir '{tmp_path / 'run'}' is in use by another run")
    assert train_cli.main([DEMO, f"--run.dir={tmp_path / 'run'}"]) == 0  # and the run releases it at its end
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_two_runs_of_different_run_dirs_cannot_share_one_checkpoint_dir(tmp_path) -> None:
    """The lock covered the run directory only (issue 37 item 10): a second run with its own run.dir saved into the
    first one's checkpoint.dir (and pruned its steps)."""
    from moerl import run
    from moerl.config import load_config

    shared = tmp_path / "ckpts"
    first = run.prepare(load_config(DEMO, [f"--run.dir={tmp_path / 'a'}", f"--checkpoint.dir={shared}"]))
    try:
        with pytest.raises(PreflightError, match=rf"^checkpoint.dir '{shared}' is in use by another run: pid "
                                                 rf"{os.getpid()} .*choose another --checkpoint.dir"):
            run.prepare(load_config(DEMO, [f"--run.dir={tmp_path / 'b'}", f"--checkpoint.dir={shared}"]))
        assert not (tmp_path / "b").exists()  # the refused run left nothing behind
    finally:
        first.release()
    assert not (shared / LOCK_FILE).exists() and not (tmp_path / "a" / LOCK_FILE).exists()
    run.prepare(load_config(DEMO, [f"--run.dir={tmp_path / 'b'}", f"--checkpoint.dir={shared}"])).release()
