"""Run outputs: metrics/trajectories JSONL, resume, crash-safe reading, TensorBoard, plots, progress line."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import struct
import sys
import warnings
from pathlib import Path

import pytest
import torch

from moerl.runlog import run_log as run_log_mod
from moerl.runlog.progress import Progress, format_duration, format_line
from moerl.runlog.run_log import RunLog, read_expert_load, read_jsonl

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------------------------------------- metrics


def test_metrics_lines_parseable_with_step_and_time(tmp_path: Path) -> None:
    with RunLog(tmp_path, tensorboard=False) as log:
        for step in range(1, 4):
            log.log_step(step, {"reward/mean": 0.1 * step, "loss": torch.tensor(1.5), "tokens": 100 + step})
    raw = lines(tmp_path / "metrics.jsonl")
    assert len(raw) == 3
    rows = [json.loads(r) for r in raw]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["reward/mean"] == pytest.approx(0.2)
    assert rows[0]["loss"] == 1.5 and rows[2]["tokens"] == 103
    times = [r["time"] for r in rows]
    assert all(isinstance(t, float) and t >= 0 for t in times) and times == sorted(times)
    assert read_jsonl(tmp_path / "metrics.jsonl") == rows


def test_non_finite_metrics_become_null(tmp_path: Path) -> None:
    with RunLog(tmp_path, tensorboard=False) as log:
        row = log.log_step(1, {"a": float("nan"), "b": float("inf"), "c": -math.inf, "d": torch.tensor(float("nan")),
                               "e": None, "f": 2.0, "g": True})
        with pytest.raises(TypeError, match="'h' must be a number"):
            log.log_step(2, {"h": "text"})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (parsed,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert parsed == row
    assert parsed["a"] is None and parsed["b"] is None and parsed["c"] is None and parsed["d"] is None
    assert parsed["e"] is None and parsed["f"] == 2.0 and parsed["g"] == 1


def test_trajectories_appended_in_time_order(tmp_path: Path) -> None:
    log = RunLog(tmp_path, tensorboard=False)
    expected = []
    for step in range(3):
        batch = [
            {"step": step, "task_id": f"t{step}", "sample_index": i, "versions": [step, step + 1],
             "reward": float(i), "prompt_len": 7, "completion_len": 3 + i, "finish_reason": "stop"}
            for i in range(4)
        ]
        log.log_trajectories(batch)
        expected += batch
        # flushed on every call: readable before close
        assert len(read_jsonl(tmp_path / "trajectories.jsonl")) == len(expected)
    log.log_trajectories([])
    log.log_trajectories([{"step": 3, "task_id": "x", "sample_index": 0, "versions": torch.tensor([3, 3]),
                           "reward": float("nan"), "prompt_len": 1, "completion_len": 1, "extra": (1, 2)}])
    log.close()
    rows = read_jsonl(tmp_path / "trajectories.jsonl")
    assert rows[:-1] == expected
    assert rows[-1]["versions"] == [3, 3] and rows[-1]["reward"] is None and rows[-1]["extra"] == [1, 2]
    assert [(r["step"], r["sample_index"]) for r in rows] == sorted((r["step"], r["sample_index"]) for r in rows)


def test_closed_runlog_refuses_writes(tmp_path: Path) -> None:
    log = RunLog(tmp_path, tensorboard=False)
    log.close()
    log.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        log.log_step(1, {})


# ------------------------------------------------------------------------------------- resume and crashes


def test_resume_appends_and_fresh_run_truncates(tmp_path: Path) -> None:
    with RunLog(tmp_path, tensorboard=False) as log:
        for step in (1, 2):
            log.log_step(step, {"reward/mean": 0.5})
            log.log_trajectories([{"step": step, "task_id": "a", "sample_index": 0}])
    last_time = read_jsonl(tmp_path / "metrics.jsonl")[-1]["time"]
    with RunLog(tmp_path, tensorboard=False, resume=True) as log:
        log.log_step(3, {"reward/mean": 0.6})
        log.log_trajectories([{"step": 3, "task_id": "b", "sample_index": 0}])
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert metrics[-1]["time"] >= last_time  # time continues across the resume
    assert [r["step"] for r in read_jsonl(tmp_path / "trajectories.jsonl")] == [1, 2, 3]

    with RunLog(tmp_path, tensorboard=False) as log:  # a new run starts over
        log.log_step(1, {"reward/mean": 0.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]
    assert read_jsonl(tmp_path / "trajectories.jsonl") == []


def test_read_jsonl_skips_truncated_last_line(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n\n{"step": 2}\n\n')  # blank lines are fine
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"step": 2')  # partial line cut mid-number
    assert read_jsonl(path) == [{"step": 1}]
    path.write_bytes(b'{"step": 1}\n{"s\xc3')  # cut inside a multi-byte character
    assert read_jsonl(path) == [{"step": 1}]
    path.write_text('{"step": 1}\n{"step": 2}')  # complete, only the newline missing: kept
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')  # corruption elsewhere is an error...
    with pytest.raises(ValueError, match=r"m.jsonl:2"):
        read_jsonl(path)
    with pytest.warns(UserWarning, match="m.jsonl:2"):  # ...unless asked to skip it
        assert read_jsonl(path, strict=False) == [{"step": 1}, {"step": 3}]
    assert read_jsonl(tmp_path / "missing.jsonl", missing_ok=True) == []
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")


def test_resume_after_crash_repairs_the_partial_last_line(tmp_path: Path) -> None:
    with RunLog(tmp_path, tensorboard=False) as log:
        log.log_step(1, {"reward/mean": 0.1})
        log.log_trajectories([{"step": 1, "sample_index": 0}])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward/me')  # the crash
    with open(tmp_path / "trajectories.jsonl", "a") as f:
        f.write('{"step": 2, "sample_index": 0}')  # complete but no newline
    with RunLog(tmp_path, tensorboard=False, resume=True) as log:
        log.log_step(2, {"reward/mean": 0.2})
        log.log_trajectories([{"step": 2, "sample_index": 1}])
    # strict reading: no line in the middle is broken
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [(r["step"], r["sample_index"]) for r in read_jsonl(tmp_path / "trajectories.jsonl")] == [
        (1, 0), (2, 0), (2, 1)
    ]


# ------------------------------------------------------------------------------------------ tensorboard


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard not installed")
def test_tensorboard_event_file_created(tmp_path: Path) -> None:
    with RunLog(tmp_path) as log:
        log.log_step(1, {"reward/mean": 0.3, "nan": float("nan")})
        log.log_step(2, {"reward/mean": 0.4})
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "reward/mean" in acc.Tags()["scalars"]
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("reward/mean")] == [(1, 0.3), (2, 0.4)]


def test_tensorboard_off_or_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with RunLog(tmp_path / "off", tensorboard=False) as log:
        log.log_step(1, {"x": 1.0})
    assert not (tmp_path / "off" / "tensorboard").exists()

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    monkeypatch.setattr(run_log_mod, "_tensorboard_warned", False)
    with pytest.warns(RuntimeWarning, match="TensorBoard logging disabled"):
        log = RunLog(tmp_path / "missing")
        log.log_step(1, {"x": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: no second warning, from this RunLog or another
        log.log_step(2, {"x": 2.0})
        log.close()
        with RunLog(tmp_path / "missing2") as other:
            other.log_step(1, {"x": 1.0})
    assert [r["step"] for r in read_jsonl(tmp_path / "missing" / "metrics.jsonl")] == [1, 2]


# ---------------------------------------------------------------------------------------- expert loads


def test_expert_load_windows(tmp_path: Path) -> None:
    log = RunLog(tmp_path, tensorboard=False, expert_load_window_steps=2, expert_load_windows=2)
    for step in range(6):  # windows 0 (steps 0-1), 1 (2-3), 2 (4-5): the first one is dropped
        log.log_expert_load(step, "rollout", torch.full((3, 4), step, dtype=torch.int64))
        log.log_expert_load(step, "trainer", [[1, 0], [0, 1]])
        log.log_step(step, {})
    log.log_expert_load(0, "rollout", [[1] * 4] * 3)  # older than every window kept: ignored
    log.log_expert_load(6, "rollout", torch.zeros(0, 4))  # no MoE layers: ignored
    with pytest.raises(ValueError):
        log.log_expert_load(6, "rollout", [1, 2, 3])
    with pytest.raises(ValueError):
        log.log_expert_load(6, "rollout", [[1, 2], [3]])
    with pytest.raises(ValueError):
        log.log_expert_load(6, "rollout", [[1, -2]])
    with pytest.raises(ValueError):
        log.log_expert_load(6, "other", [[1]])  # type: ignore[arg-type]
    log.close()
    data = read_expert_load(tmp_path)
    assert data is not None
    rollout = data["rollout"]
    assert [(w["first_step"], w["last_step"], w["calls"]) for w in rollout] == [(2, 3, 2), (4, 5, 2)]
    assert rollout[0]["counts"] == [[5] * 4] * 3 and rollout[1]["counts"] == [[9] * 4] * 3
    assert data["trainer"][-1]["counts"] == [[2, 0], [0, 2]]

    with RunLog(tmp_path, tensorboard=False, resume=True, expert_load_window_steps=2,
                expert_load_windows=2) as log:  # a resume keeps them and goes on
        log.log_expert_load(5, "rollout", torch.ones(3, 4, dtype=torch.int64))
    data = read_expert_load(tmp_path)
    assert data["rollout"][-1]["counts"] == [[10] * 4] * 3 and data["rollout"][-1]["calls"] == 3

    with RunLog(tmp_path, tensorboard=False):  # a new run drops them
        pass
    assert read_expert_load(tmp_path) is None


# ---------------------------------------------------------------------------------------------- plots


def fake_run(run_dir: Path, steps: int = 20, layers: int = 6, experts: int = 16) -> None:
    gen = torch.Generator().manual_seed(0)
    with RunLog(run_dir, tensorboard=False, expert_load_window_steps=5) as log:
        for step in range(1, steps + 1):
            metrics = {
                "reward/mean": 0.2 + 0.03 * step + 0.05 * torch.randn(1, generator=gen).item(),
                "throughput/samples_per_s": 30 + torch.rand(1, generator=gen).item() * 10,
                "throughput/tokens_per_s": 8000 + torch.rand(1, generator=gen).item() * 1000,
                "staleness/mean": torch.rand(1, generator=gen).item(),
                "queue/pending": 4,
                # the controller's phases (moerl/loop/phases.py): they add up to time/step_s
                "time/train_wait_s": 0.05, "time/idle_s": 0.02 + 0.001 * step, "time/controller_s": 0.01,
                "time/publish_s": 0.004, "time/transfer_s": 0.0, "time/checkpoint_s": 0.0,
                "time/step_s": 0.084 + 0.001 * step,
            }
            if step == 5:
                metrics["reward/mean"] = float("nan")
            if step % 5 == 0:
                metrics["eval/reward"] = 0.2 + 0.03 * step
            weights = torch.linspace(0.2, 2.0, experts)
            for source in ("rollout", "trainer"):
                counts = torch.stack([
                    torch.multinomial(weights, 512, replacement=True, generator=gen).bincount(minlength=experts)
                    for _ in range(layers)
                ])
                counts[0] = 0 if step > 15 and source == "trainer" else counts[0]  # an all-zero row
                log.log_expert_load(step, source, counts)
            log.log_step(step, metrics)


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib not installed")
def test_plots_for_a_20_step_run(tmp_path: Path) -> None:
    from moerl.runlog.plots import write_plots

    fake_run(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no plot failed
        written = write_plots(tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["expert_load_rollout.png", "expert_load_trainer.png", "reward.png", "step_time.png",
                     "throughput.png"]
    for path in written:
        assert path.parent == tmp_path
        width, height = png_size(path)
        assert width >= 400 and height >= 250
        assert path.stat().st_size > 10_000, f"{path.name} looks empty"
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib not installed")
def test_plots_for_a_1_step_run_with_missing_keys(tmp_path: Path) -> None:
    from moerl.runlog.plots import write_plots

    with RunLog(tmp_path, tensorboard=False) as log:
        log.log_step(1, {"reward/mean": 0.5, "staleness/mean": float("nan")})
        log.log_expert_load(1, "trainer", [[3, 1, 0, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = write_plots(tmp_path)
    assert sorted(p.name for p in written) == ["expert_load_trainer.png", "reward.png"]
    for path in written:
        png_size(path)
        assert path.stat().st_size > 5_000

    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_plots(empty) == []  # no metrics.jsonl at all
    with RunLog(empty, tensorboard=False) as log:
        log.log_step(1, {"reward/mean": float("nan"), "throughput/samples_per_s": None})
    assert write_plots(empty) == []  # nothing finite to plot


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib not installed")
def test_plots_after_a_resume_and_a_crash(tmp_path: Path) -> None:
    from moerl.runlog.plots import write_plots

    fake_run(tmp_path, steps=6)
    with RunLog(tmp_path, tensorboard=False, resume=True) as log:  # redo steps 5-6 (last line wins)
        for step in (5, 6, 7):
            log.log_step(step, {"reward/mean": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "rew')
    assert {p.name for p in write_plots(tmp_path)} >= {"reward.png", "throughput.png"}


# -------------------------------------------------------------------------------------------- progress

FULL = {"reward/mean": 0.41, "throughput/samples_per_s": 38.2, "staleness/mean": 0.8, "queue/pending": 5,
        "workers/alive": 2, "workers/target": 2}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_progress_line_content() -> None:
    assert format_line(12, 50, FULL, 73) == (
        "step 12/50 | reward 0.41 | 38.2 samples/s | staleness 0.8 | queue 5 | workers 2/2 | 0:01:13"
    )
    assert format_line(1, 50, {}, 0) == "step 1/50 | 0:00:00"
    health = {"reward/mean": 0.41, "policy/entropy": 0.617, "is/ess": 0.9712, "policy/clip_frac": 0.031,
              "staleness/mean": 2.0}
    assert format_line(12, 50, health, 73) == (
        "step 12/50 | reward 0.41 | entropy 0.62 | ess 0.97 | clip 0.03 | staleness 2.0 | 0:01:13")
    # on a narrow terminal the queue-like fields go first, then clip, ess and entropy, before reward and time
    assert format_line(12, 50, health, 73, width=61) == "step 12/50 | reward 0.41 | entropy 0.62 | ess 0.97 | 0:01:13"
    phases = {"time/step_s": 0.08, "time/train_wait_s": 0.05, "time/idle_s": 0.02, "time/controller_s": 0.01,
              "time/publish_s": 0.001}  # under 5%: left out
    assert format_line(2, 9, phases, 5) == "step 2/9 | 0.08s: train 62% rollout 25% ctl 12% | 0:00:05"
    assert format_line(3, 5, {"reward/mean": float("nan"), "workers/alive": 1, "queue/pending": None}, 3661) == (
        "step 3/5 | reward nan | queue - | workers 1 | 1:01:01"
    )
    assert format_line(3, 5, {"reward/mean": torch.tensor(-0.123456)}, 0).startswith("step 3/5 | reward -0.123 |")
    growing = {"workers/alive": 64, "workers/target": 256, "workers/waiting": 192}  # a fleet waiting for spot nodes
    assert format_line(3, 5, growing, 0) == "step 3/5 | workers 64 of 256 up, 192 waiting for capacity | 0:00:00"
    assert format_line(3, 5, {**growing, "workers/waiting": 0}, 0) == "step 3/5 | workers 64/256 | 0:00:00"
    assert format_duration(100 * 3600 + 5) == "100:00:05"


def test_progress_tty_rewrites_in_place() -> None:
    stream = io.StringIO()
    stream.isatty = lambda: True  # type: ignore[method-assign]
    clock = FakeClock()
    progress = Progress(50, stream, clock=clock)
    assert progress.tty
    clock.t += 73
    progress.update(12, FULL)
    first = "step 12/50 | reward 0.41 | 38.2 samples/s | staleness 0.8 | queue 5 | workers 2/2 | 0:01:13"
    assert stream.getvalue() == "\r" + first
    progress.update(13, {"reward/mean": 0.5})  # shorter: padded over the old line
    out = stream.getvalue()
    second = "step 13/50 | reward 0.5 | 0:01:13"
    assert out == "\r" + first + "\r" + second + " " * (len(first) - len(second))
    assert "\n" not in out
    progress.message("worker 1 lost")
    assert "worker 1 lost\n" in stream.getvalue() and stream.getvalue().endswith("\r" + second)
    progress.close()
    progress.close()
    assert stream.getvalue().endswith(second + "\n")


def test_progress_non_tty_prints_full_lines_rarely() -> None:
    stream = io.StringIO()
    stream.isatty = lambda: False  # type: ignore[method-assign]
    clock = FakeClock()
    progress = Progress(50, stream, log_interval_s=10.0, clock=clock)
    assert not progress.tty
    for step in range(1, 48):  # one step every 3 s: a line at most every 10 s
        clock.t += 3
        progress.update(step, {"reward/mean": step / 100})
    out = stream.getvalue()
    assert "\r" not in out
    printed = [int(line.split()[1].split("/")[0]) for line in out.splitlines()]
    assert printed == [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]
    progress.close()  # the last state not printed yet
    assert stream.getvalue().splitlines()[-1].startswith("step 47/50 | reward 0.47")

    stream = io.StringIO()
    progress = Progress(3, stream, log_interval_s=0.0, clock=clock)  # every step, never twice a step
    for step in (1, 2, 2, 3):
        progress.update(step, FULL)
    progress.close()
    assert [line.split(" | ")[0] for line in stream.getvalue().splitlines()] == ["step 1/3", "step 2/3", "step 3/3"]

    stream = io.StringIO()
    progress = Progress(3, stream, log_interval_s=1e9, clock=clock)  # the first and the final step always
    for step in (1, 2, 3):
        progress.update(step, FULL)
    progress.close()
    assert [line.split(" | ")[0] for line in stream.getvalue().splitlines()] == ["step 1/3", "step 3/3"]


def test_progress_silent_without_stream() -> None:
    progress = Progress(2, None)
    assert progress.update(1, FULL).startswith("step 1/2")
    progress.close()


def test_progress_writes_to_the_stderr_of_now_not_of_import(monkeypatch) -> None:
    """A default bound at import wrote every later run's lines to the first test's captured stream."""
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    progress = Progress(1, log_interval_s=0.0)
    progress.update(1, FULL)
    progress.close()
    assert now.getvalue().startswith("step 1/1")


def test_resume_drops_the_rows_of_steps_after_the_checkpoint(tmp_path):
    """A run killed at step 5 resumes from its checkpoint at step 3: steps 4-5 are trained again, so their
    metrics and trajectories must not stay in the log twice."""
    log = RunLog(tmp_path, tensorboard=False)
    log.log_step(-1, {"sft/loss": 1.0})
    for step in range(1, 6):
        log.log_step(step, {"reward/mean": step / 10})
        log.log_trajectories([{"step": step, "task_id": f"t{step}", "sample_index": i} for i in range(2)])
    log.close()
    log = RunLog(tmp_path, tensorboard=False, resume=True)
    assert log.truncate_after(3) == 2 + 4
    for step in (4, 5):
        log.log_step(step, {"reward/mean": 0.0})
        log.log_trajectories([{"step": step, "task_id": f"t{step}", "sample_index": 0}])
    log.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [-1, 1, 2, 3, 4, 5]
    traj = read_jsonl(tmp_path / "trajectories.jsonl")
    assert [(r["step"], r["sample_index"]) for r in traj] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1),
                                                              (4, 0), (5, 0)]


def test_resume_streams_the_logs_it_trims(tmp_path):
    """Issue 26 item 9: resume read all of trajectories.jsonl into memory (~11x its size) to trim it."""
    import tracemalloc

    RunLog(tmp_path, tensorboard=False).close()
    text = "x" * 2000
    with open(tmp_path / "trajectories.jsonl", "w") as f:  # ~20 MB: 200 rows of ~2.5 KB for each of 40 steps
        for i in range(8000):
            f.write(json.dumps({"step": i // 200 + 1, "sample_index": i % 200, "completion": text}) + "\n")
        f.write('{"step": 41, "completion": "cut sh')  # a crash mid-write
    size = (tmp_path / "trajectories.jsonl").stat().st_size
    log = RunLog(tmp_path, tensorboard=False, resume=True)
    tracemalloc.start()
    try:
        dropped = log.truncate_after(20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    log.close()
    assert dropped == 20 * 200 and peak < size / 20, (peak, size)
    rows = read_jsonl(tmp_path / "trajectories.jsonl")
    assert len(rows) == 4000 and rows[-1]["step"] == 20 and rows[-1]["sample_index"] == 199
    assert (tmp_path / "trajectories.jsonl").read_bytes().endswith(b"\n")


def test_progress_line_keeps_step_reward_rate_and_eta_on_80_columns() -> None:
    """On a 100-column terminal the line was cut in its elapsed time, and its ETA was gone (issue 27 item 10)."""
    metrics = {**FULL, "reward/mean": 0.344, "throughput/samples_per_s": 747.8, "time/step_s": 0.1,
               "time/train_wait_s": 0.072, "time/controller_s": 0.02, "time/publish_s": 0.006}
    full = format_line(310, 600, metrics, 65, 24)
    assert len(full) > 100 and format_line(310, 600, metrics, 65, 24, width=200) == full
    for width in (80, 100):
        line = format_line(310, 600, metrics, 65, 24, width=width)
        assert len(line) < width, line
        assert line.startswith("step 310/600 | reward 0.344 | 747.8 samples/s | "), line
        assert line.endswith(" | 0:01:05 | eta 0:00:24"), line
    assert format_line(310, 600, metrics, 65, 24, width=100).count(" | ") > \
        format_line(310, 600, metrics, 65, 24, width=80).count(" | ")  # what fits stays
    stream = io.StringIO()
    stream.isatty = lambda: True  # type: ignore[method-assign]
    clock = FakeClock()
    progress = Progress(600, stream, clock=clock)
    progress._terminal_width = lambda: 80  # type: ignore[method-assign]
    clock.t += 65
    progress.update(300, metrics)
    clock.t += 1
    progress.update(310, metrics)
    drawn = stream.getvalue().rsplit("\r", 1)[-1].rstrip()
    assert len(drawn) < 80 and "reward 0.344" in drawn and "samples/s" in drawn and " | eta " in drawn, drawn
