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
    out = _finish(_start(run_dir, *args, "--resume"))
    assert "done:" in out
    rows = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    # The resumed run dropped the killed run's rows after its checkpoint and logged those steps again: every
    # step once, every sample once.
    assert sorted({r["step"] for r in rows}) == [1, 2, 3, 4, 5, 6]  # nothing lost
    keys = [(r["task_id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)), "a sample was logged (or trained) twice"
    steps = [r["step"] for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["step"] > 0]
    assert steps == sorted(set(steps)) == [1, 2, 3, 4, 5, 6]
