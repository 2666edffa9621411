"""A run checkpointing to S3 (moto's real S3 API on 127.0.0.1) is SIGKILLed mid-run and resumed from S3."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.integration.test_checkpoint_s3 import s3_endpoint, s3_root  # noqa: F401 - fixtures
from tests.integration.test_resume import _finish, _start, _wait_for_step

pytestmark = pytest.mark.integration


def test_sigkill_run_checkpointing_to_s3_then_resume(tmp_path, s3_root):  # noqa: F811
    run_dir = tmp_path / "run"
    args = ["--train.steps=6", f"--checkpoint.dir={s3_root}"]  # subprocesses inherit the moto endpoint env
    victim = _start(run_dir, *args)
    _wait_for_step(run_dir, 3, victim)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    traj = run_dir / "trajectories.jsonl"
    killed_rows = sum(line.endswith("}") for line in traj.read_text().splitlines())  # complete rows of the killed run
    out = _finish(_start(run_dir, *args, "--resume"))
    assert "done:" in out
    rows = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 6
    # The trajectories hold the killed timeline, then the resumed one (it re-trains from the checkpoint on).
    cut = killed_rows
    checkpoint_step = rows[cut]["step"] - 1 if cut < len(rows) else 6
    surviving = [r for r in rows[:cut] if r["step"] <= checkpoint_step] + rows[cut:]
    assert sorted({r["step"] for r in surviving}) == [1, 2, 3, 4, 5, 6]  # nothing lost
    keys = [(r["task_id"], r["sample_index"]) for r in surviving]
    assert len(keys) == len(set(keys)), "a sample was trained twice in the surviving timeline"
