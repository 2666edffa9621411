"""What the user sees of a run (moerl/runlog/reporter.py and friends): the windowed throughput, trajectory rows
with their text, sample completions in TensorBoard, start-up/warm-start/event lines and the ETA, the event
hooks of the checkpointer and the rollout pool, optional W&B, the throughput plot, a fast close."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import struct
import sys
import types
from pathlib import Path

import pytest

from moerl.runlog.progress import Progress, format_line
from moerl.runlog.reporter import RunReporter, pick_samples, samples_markdown
from moerl.runlog.run_log import read_jsonl

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _stream(tty: bool = False) -> io.StringIO:
    stream = io.StringIO()
    stream.isatty = lambda: tty  # type: ignore[method-assign]
    return stream


def _reporter(tmp_path: Path, clock: Clock, **kw) -> tuple[RunReporter, io.StringIO]:
    stream = _stream(kw.pop("tty", False))
    kw.setdefault("tensorboard", False)
    kw.setdefault("plot_every_s", 0)
    return RunReporter(tmp_path, 10, stream=stream, clock=clock, **kw), stream


def _rows(step: int, rewards: list[float]) -> list[dict]:
    return [{"step": step, "task_id": f"t-{i // 2}", "sample_index": i % 2, "reward": r, "prompt": "1+2=",
             "completion": f"{i}", "answer": "3", "finish_reason": "stop", "completion_ids": [i]}
            for i, r in enumerate(rewards)]


# ------------------------------------------------------------------------------------------ reporter


def test_throughput_is_windowed_not_the_run_average(tmp_path: Path) -> None:
    clock = Clock()
    report, _ = _reporter(tmp_path, clock, throughput_window=2)
    report.begin_rl()
    rates = []
    for step, seconds in enumerate([1.0, 1.0, 4.0, 4.0], start=1):  # 8 samples per step: 8/s, then 2/s
        clock.t += seconds
        row = report.step(step, {"samples": 8, "tokens": 80, "reward/mean": 0.5})
        rates.append((row["throughput/samples_per_s"], row["throughput/samples_per_s_avg"]))
    assert rates[1] == (pytest.approx(8.0), pytest.approx(8.0))
    assert rates[3] == (pytest.approx(2.0), pytest.approx(32 / 10))  # the window forgot the fast steps
    assert row["throughput/tokens_per_s"] == pytest.approx(20.0)
    report.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_rows_expert_counts_events_and_eval_lines(tmp_path: Path) -> None:
    clock = Clock()
    report, stream = _reporter(tmp_path, clock)
    report.stage("starting a local Ray (2 CPUs)")
    clock.t += 3
    for i in range(2):
        report.warm_start(i, 2, {"loss/sft": 2.0 - i})
    report.begin_rl()
    clock.t += 1
    report.step(1, {"samples": 4, "reward/mean": 0.5, "expert_counts_rollout": [[1, 2]], "expert_counts": [[2, 1]]},
                _rows(1, [1.0, 0.0]))
    report.log_metrics(0, {"eval/reward": 0.25, "eval/partial": False})
    report.event("eval", "eval at step 0: reward 0.250")
    report.event("checkpoint", "checkpoint step 1 saved to /ckpt/step-1")
    report.event("warning", "checkpoint step 2 failed")
    report.close()
    out = stream.getvalue().splitlines()
    assert out[0] == "[0:00:00] starting a local Ray (2 CPUs)"
    assert out[1].startswith("warm start 1/2 | loss/sft 2 | 0:00:03")
    assert out[2].startswith("warm start 2/2 | loss/sft 1 | 0:00:03")
    assert out[3].startswith("step 1/10 | reward 0.5 |")
    assert out[4:7] == ["[0:00:04] eval at step 0: reward 0.250",
                        "[0:00:04] checkpoint step 1 saved to /ckpt/step-1",
                        "[0:00:04] warning: checkpoint step 2 failed"]
    assert out[-1].startswith(f"[0:00:04] outputs in {tmp_path} (closed in")
    assert [k for k, _ in report.events] == ["eval", "checkpoint", "warning"]
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [-2, -1, 1, 0] and metrics[0]["sft/loss/sft"] == 2.0
    assert metrics[-1]["eval/reward"] == 0.25 and metrics[-1]["eval/partial"] == 0.0
    assert "expert_counts" not in metrics[-1] and json.loads((tmp_path / "expert_load.json").read_text())["trainer"]
    traj = read_jsonl(tmp_path / "trajectories.jsonl")
    assert [(t["prompt"], t["completion"], t["answer"]) for t in traj] == [("1+2=", "0", "3"), ("1+2=", "1", "3")]


def _events(log_dir: Path) -> list:
    """The Event protos of TensorBoard's event files (TFRecord framing: length, crc, data, crc)."""
    from tensorboard.compat.proto.event_pb2 import Event

    events = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            events.append(Event.FromString(data[pos + 12:pos + 12 + length]))
            pos += 12 + length + 4
    return events


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard not installed")
def test_sample_completions_in_tensorboard_per_interval(tmp_path: Path) -> None:
    clock = Clock()
    report, _ = _reporter(tmp_path, clock, tensorboard=True, samples_every_s=60, samples_per_log=3)
    report.begin_rl()
    for step in range(1, 11):
        clock.t += 25  # text at steps 1, 4, 7 (every 60 s) and 10 (the last)
        report.step(step, {"reward/mean": 0.1 * step, "samples": 4}, _rows(step, [0.0, 1.0, 0.5, 0.25]))
    report.close()
    values = [(e.step, v) for e in _events(tmp_path / "tensorboard") for v in e.summary.value]
    texts = [(step, v.tensor.string_val[0].decode()) for step, v in values if v.tag == "samples/text_summary"]
    assert [step for step, _ in texts] == [1, 4, 7, 10]
    assert texts[-1][1].count("**reward") == 3 and "    completion: 1" in texts[-1][1]
    assert "    answer:     3" in texts[-1][1]
    rewards = [(step, v.simple_value) for step, v in values if v.tag == "reward/mean"]
    assert [step for step, _ in rewards] == list(range(1, 11)) and rewards[-1][1] == pytest.approx(1.0)
    assert len([1 for _, v in values if v.tag == "throughput/samples_per_s"]) == 10


def test_pick_samples_and_markdown() -> None:
    rows = _rows(1, [0.5, 0.0, 1.0, 0.25, 0.75])
    assert [r["reward"] for r in pick_samples(rows, 3)] == [0.0, 0.5, 1.0]
    assert [r["reward"] for r in pick_samples(rows, 1)] == [1.0] and pick_samples([], 3) == []
    md = samples_markdown(7, [{"reward": 1.0, "task_id": "t", "sample_index": 2, "prompt": "a\nb",
                               "completion": "x" * 3000, "answer": None, "finish_reason": "length"}])
    assert md.startswith("step 7\n\n**reward 1** · task `t` sample 2 · cut at max_new_tokens")
    assert "    prompt:     a\n                b\n" in md and "(3000 characters)" in md


def test_plots_written_in_the_background_and_closed_fast(tmp_path: Path) -> None:
    if not HAS_MATPLOTLIB:
        pytest.skip("matplotlib not installed")
    import time

    clock = Clock()
    report, _ = _reporter(tmp_path, clock, plot_every_s=0.05)
    for step in range(1, 4):
        clock.t += 1
        report.step(step, {"reward/mean": 0.5, "samples": 8, "staleness/max": 1.0})
    deadline = time.monotonic() + 30
    while report.plots.writes == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert report.plots.writes >= 1 and (tmp_path / "reward.png").exists()  # written while the run goes on
    report.step(4, {"reward/mean": 0.75, "samples": 8})
    report.finish()
    timings = report.close()
    assert set(timings) >= {"progress", "run log", "plots", "total"}
    assert {"reward.png", "throughput.png"} <= {p.name for p in tmp_path.glob("*.png")}


# ------------------------------------------------------------------------------------------ progress


def test_eta_and_warm_start_lines() -> None:
    clock = Clock()
    stream = _stream(tty=True)
    progress = Progress(10, stream, clock=clock)
    progress.stage("starting 1 trainer rank")
    for i in range(1, 3):
        clock.t += 0.5
        progress.warm_start(i, 2, {"sft/loss/sft": 1.0 / i, "sft/tokens": 9})
    assert stream.getvalue().endswith("warm start 2/2 | loss/sft 0.5 | 0:00:01\n")  # the warm start's line stays
    for step in (1, 2, 3):
        clock.t += 2
        line = progress.update(step, {"reward/mean": 0.5})
    assert line == "step 3/10 | reward 0.5 | 0:00:07 | eta 0:00:14"  # 7 steps left at 2 s each
    assert format_line(10, 10, {}, 5, eta_s=0.0) == "step 10/10 | 0:00:05"  # no ETA once done
    progress.close()
    assert stream.getvalue().startswith("[0:00:00] starting 1 trainer rank\n\rwarm start 1/2")


def test_non_tty_prints_the_first_line_of_each_phase() -> None:
    clock = Clock()
    stream = _stream()
    progress = Progress(3, stream, log_interval_s=1e9, clock=clock)
    for i in range(1, 4):
        progress.warm_start(i, 3, {"loss/sft": 1.0})
    progress.update(1, {})
    progress.update(2, {})
    progress.close()
    assert [line.split(" | ")[0] for line in stream.getvalue().splitlines()] == [
        "warm start 1/3", "warm start 3/3", "step 1/3", "step 2/3"]


# ------------------------------------------------------------------------------------------ event hooks


def test_rollout_pool_says_which_worker_was_lost_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import moerl.actors.pools as pools_mod
    from moerl.actors.pools import RayRolloutPool, _Worker
    from moerl.actors.respawn import RespawnPolicy

    monkeypatch.setattr(pools_mod.ray, "kill", lambda *a, **k: None)  # ray.kill would start a local Ray

    events: list[tuple[str, str]] = []
    pool = object.__new__(RayRolloutPool)  # no Ray: only the bookkeeping that emits events
    pool.target, pool._start_failures, pool.on_event = 2, 0, lambda kind, text: events.append((kind, text))
    pool.min_workers, pool._serving = 2, False  # what __init__ sets: leases wait for 2 workers up
    pool.respawn = RespawnPolicy(8, 1.0, 60.0)  # what __init__ sets (moerl/actors/respawn.py)
    pool.workers = {"rollout-0": _Worker(handle=None, lost_reason="no heartbeat for 61 s"),
                    "rollout-1": _Worker(handle=None, leaving=True), "rollout-2": _Worker(handle=None)}
    pool._started("rollout-2", pool.workers["rollout-2"])
    assert pool.remove("rollout-0") and pool.remove("rollout-1") and not pool.remove("rollout-0")
    assert events == [("worker", "rollout worker rollout-2 up (1 of 2 up, 2 starting)"),
                      ("worker", "rollout worker rollout-0 lost: no heartbeat for 61 s"),
                      ("worker", "rollout worker rollout-1 retired (preempted; its work was handed back)")]


def test_checkpointer_reports_commits_and_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import moerl.actors.checkpointer as checkpointer_mod
    from moerl.actors.checkpointer import Checkpointer
    from moerl.model import tiny_config

    class Trainer:
        fail = False

        def save_state(self, path: str, use_async: bool, target=None) -> None:
            if self.fail:
                raise OSError(errno.ENOSPC, "No space left on device")

        def save_done(self) -> list:
            return ["ref"]

    fake_ray = types.SimpleNamespace(get=lambda refs, timeout=None: [{}], wait=lambda refs, **_: (refs, []),
                                     exceptions=checkpointer_mod.ray.exceptions)
    monkeypatch.setattr(checkpointer_mod, "ray", fake_ray)
    events: list[tuple[str, str]] = []
    ckpt = Checkpointer(str(tmp_path / "ckpts"), keep=2, arch=tiny_config(), fingerprint={},
                        on_event=lambda kind, text: events.append((kind, text)))
    trainer = Trainer()
    ckpt.save(5, trainer, {"step": 5})
    assert ckpt.wait() == 5
    trainer.fail = True
    ckpt.save(10, trainer, {"step": 10})
    assert events[0] == ("checkpoint", f"checkpoint step 5 saved to {ckpt.store.step_path(5)}")
    assert events[1][0] == "warning" and "checkpoint step 10" in events[1][1] and "training goes on" in events[1][1]


# ------------------------------------------------------------------------------------------ Weights & Biases


class FakeWandb(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("wandb")
        self.calls: list[tuple] = []

    def init(self, **kw):
        self.calls.append(("init", kw))
        wandb = self

        class Run:
            def define_metric(self, *a, **k):
                wandb.calls.append(("define_metric", a, k))

            def log(self, data):
                wandb.calls.append(("log", data))

            def finish(self):
                wandb.calls.append(("finish",))

        return Run()

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data


def test_wandb_logs_scalars_samples_and_resumes_its_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    clock = Clock()
    settings = {"project": "p", "name": "demo", "mode": "offline"}
    report, _ = _reporter(tmp_path, clock, wandb=settings, config={"train": {"steps": 10}})
    report.warm_start(0, 1, {"loss/sft": 2.0})
    clock.t += 1
    report.step(1, {"reward/mean": 0.5, "samples": 2}, _rows(1, [0.0, 1.0]))
    report.close()
    init = fake.calls[0][1]
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert init == {"project": "p", "name": "demo", "id": run_id, "resume": "allow", "dir": str(tmp_path),
                    "mode": "offline", "config": {"train": {"steps": 10}}}
    logs = [c[1] for c in fake.calls if c[0] == "log"]
    assert logs[0]["trainer_step"] == -1 and logs[0]["sft/loss/sft"] == 2.0
    assert logs[1]["trainer_step"] == 1 and logs[1]["reward/mean"] == 0.5 and "step" not in logs[1]
    assert logs[2]["samples"].columns == ["step", "reward", "prompt", "completion", "answer"]
    assert fake.calls[-1] == ("finish",)
    fake.calls.clear()
    report, _ = _reporter(tmp_path, clock, wandb=settings, resume=True)
    report.close()
    assert fake.calls[0][1]["id"] == run_id  # a resumed run continues its W&B run


def test_wandb_missing_is_one_line_before_ray_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    import ray

    from moerl.train_cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    rc = main(["configs/demo.toml", f"--run.dir={tmp_path / 'run'}", "--run.wandb=true"])
    out = capsys.readouterr()
    assert rc == 2 and out.err == "error: run.wandb = true needs the wandb package: pip install wandb\n"
    assert not ray.is_initialized() and not (tmp_path / "run").exists()  # the preflight leaves nothing behind


# ------------------------------------------------------------------------------------------ throughput.png


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib not installed")
def test_throughput_plot_is_windowed_from_zero_with_flat_lines_inside_the_frame() -> None:
    from moerl.runlog.plots import _throughput_figure, _windowed_rate

    rows, t = [], 0.0
    for step in range(1, 101):
        t += 0.5 if step <= 50 else 2.0  # 16 samples/s, then 4 samples/s
        rows.append({"step": step, "time": t, "samples": 8, "staleness/mean": 0.5, "staleness/max": 1.0})
    steps, rates, average = _windowed_rate(rows, "samples", 5)
    assert steps[0] == 2 and rates[10] == pytest.approx(16.0) and rates[-1] == pytest.approx(4.0)
    assert average == pytest.approx(99 * 8 / (t - 0.5))
    fig = _throughput_figure(rows, "run")
    samples_ax, staleness_ax = fig.axes
    assert samples_ax.get_ylim()[0] == 0 and samples_ax.get_ylim()[1] > 16.0
    assert staleness_ax.get_ylim()[0] == 0 and staleness_ax.get_ylim()[1] > 1.0  # the flat max at 1 is visible
    assert "last 5 steps" in samples_ax.get_title() or "last 5 steps" in fig.axes[0].get_title()
    assert not math.isnan(rates[-1])


def test_an_eval_line_does_not_move_its_steps_time(tmp_path: Path) -> None:
    from moerl.runlog.plots import _metric_rows
    from moerl.runlog.run_log import RunLog

    with RunLog(tmp_path, tensorboard=False) as log:
        log.log_step(1, {"samples": 8, "time": 0})  # a row's own `time` key is ignored: the log's clock
        log.log_step(2, {"samples": 8})
        log.log_step(1, {"eval/reward": 0.5})  # the eval of step 1's weights, logged later
    rows = _metric_rows(tmp_path)
    raw = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[0]["eval/reward"] == 0.5 and rows[0]["samples"] == 8 and rows[0]["time"] == raw[0]["time"]


def test_behaviour_kl_over_its_bound_is_said_once_per_episode_and_kept_in_error_log(tmp_path: Path) -> None:
    """The CUDA IPC bug's signature (KL ~10 nats on every other step) is said on the first step over the bound,
    not on every step, nor again while KL flaps around the bound; its return (3 quiet steps here) is said too;
    both stay in error.log."""
    from moerl.runlog.mismatch import BehaviourKLWatch

    reporter, stream = _reporter(tmp_path, Clock())
    watch = BehaviourKLWatch(0.05, lambda text: reporter.event("warning", text), quiet_steps=3)
    kls = [0.0, 1e-4, 9.5, 0.0, 10.8, 0.0, 12.0, 0.01, 0.02, 0.0, 0.01, 0.2, 0.0]
    for step, kl in enumerate(kls, start=1):
        watch.observe(step, {"is/behaviour_kl": kl, "is/weight_max": 259.0, "is/weight_min": 0.0,
                             "staleness/mean": 0.0})
    warnings = [text for kind, text in reporter.events if kind == "warning"]
    assert watch.episodes == 2 and len(warnings) == 3, warnings
    assert warnings[0].startswith("behaviour KL 9.5 per token at step 3 is over train.behaviour_kl_bound=0.05")
    assert "weight sync" in warnings[0] and "259" in warnings[0] and "max_staleness" not in warnings[0]
    assert warnings[1] == ("behaviour KL back under 0.05 for 3 steps at step 10; steps 3-7: 3 over it (peak 12)")
    assert warnings[2].startswith("behaviour KL 0.2 per token at step 12")
    assert "warning: behaviour KL 9.5" in stream.getvalue()
    assert (tmp_path / "error.log").read_text().count("warning: behaviour KL") == 3
    reporter.close()
    stale = []
    BehaviourKLWatch(0.05, stale.append).observe(1, {"is/behaviour_kl": 0.2, "staleness/mean": 2.0})
    assert "lower train.optim.lr or train.max_staleness" in stale[0]
    off = BehaviourKLWatch(0.0, lambda text: pytest.fail(text))  # 0 = off
    off.observe(1, {"is/behaviour_kl": 50.0})


# ------------------------------------------------------------------------------------------ the summary
def test_the_summary_compares_reward_windows_and_tables_the_counters(tmp_path, capsys, monkeypatch) -> None:
    """`final reward/mean` was the last step's noisy value (0.344 where the last 50 steps averaged 0.522) and the
    counters a raw dict (issue 27 item 10)."""
    import json

    from moerl import run, train_cli
    from moerl.runlog.summary import counters_table, reward_line

    rewards = {s: (0.1 if s <= 50 else 0.5) for s in range(1, 201)} | {200: 0.3}
    assert reward_line(rewards) == ("reward/mean 0.100 over the first 50 steps, 0.496 over the last 50 (the last "
                                    "step alone: 0.300)")
    assert reward_line({1: 0.2, 2: 0.4, 3: 0.6, 4: 0.8}) == ("reward/mean 0.300 over the first 2 steps, 0.700 over "
                                                            "the last 2 (the last step alone: 0.800)")
    assert reward_line({}) is None
    counters = {"groups_done": 4817, "groups_failed": 0, "samples_trained": 38400, "samples_failed": 0,
                "stale_dropped": 412, "groups_filter_over_limit": 0}
    table = counters_table(counters)
    assert all(len(line) <= 80 for line in table) and len(table) == 3, table
    assert table[0].startswith("counters  groups_done") and "38400" in "".join(table)

    run_dir = tmp_path / "run"

    def fake_train(cfg, **kw):  # what a run of 200 steps logged
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": r}) + "\n"
                                                       for s, r in [(-1, None), *rewards.items()]))
        return {"stopped": None, "step": 200, "steps": 200, "checkpoint_step": 200, "counters": counters,
                "metrics": {"reward/mean": 0.3, "elapsed_s": 79.4}}
    monkeypatch.setattr(run, "train", fake_train)
    assert train_cli.main([str(Path(__file__).resolve().parents[2] / "configs" / "demo.toml"), f"--run.dir={run_dir}",
                     "--train.steps=200"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"done: 200 steps in 79 s; outputs in {run_dir}; the policy is checkpoint step 200",
                       "reward/mean 0.100 over the first 50 steps, 0.496 over the last 50 (the last step alone: "
                       "0.300)"], out
    assert out[2:] == table and "{" not in "".join(out)
