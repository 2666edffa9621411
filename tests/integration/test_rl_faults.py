"""Fault tolerance of the asynchronous RL loop on Ray: workers killed (SIGKILL) or preempted (SIGTERM, the
EC2 IMDS spot notice) mid-run, rewards that raise, task modules that do not import, late results.

The end-to-end tests run `train(cfg)` on the suite's local Ray (`shared_ray`, tests/integration/conftest.py), or
on a private one that `train` starts and stops (`own_ray`: the start-up paths), with a small config: a few SFT
steps, 6-16 RL steps, up to 48 new tokens per sample so that generation is in flight when a background thread
strikes a worker at step 2. Every wait is a bounded poll with a deadline.

    PYTHONPATH=. RAY_AUTH_MODE=disabled python -m pytest tests/integration/test_rl_faults.py -m integration
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moerl.config import load_config
from moerl.runlog.run_log import read_jsonl
from moerl.tasks.arithmetic import ArithmeticTask

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.toml"
FLAKY = "tests.integration.test_rl_faults:FlakyTask"
GROUP = 4
STEPS = 14
# A struck run: struck at step 2, the rest through the replacement worker (one worker: the run cannot end without it)
# or the preempted groups' continuation; 14 steps after the strike, 56 groups.
RUN_STEPS = 16

pytestmark = pytest.mark.integration


# ------------------------------------------------------------------------------------------ helpers
class FlakyTask(ArithmeticTask):
    """Arithmetic whose reward raises for a deterministic subset of completions (token-id sum % 3 == 0), and
    whose prompts at index % 5 == 3 are longer than `rollout.max_seq_len` (64): every generation of them fails."""

    @staticmethod
    def flaky(completion_token_ids: list[int]) -> bool:
        return sum(completion_token_ids) % 3 == 0

    @staticmethod
    def unplayable(task_id: str) -> bool:
        return int(task_id.rsplit("-", 1)[1]) % 5 == 3

    def prompt_at(self, index: int):
        prompt = super().prompt_at(index)
        if self.unplayable(prompt.task_id):
            prompt.prompt_token_ids = prompt.prompt_token_ids + self.tokenizer.encode(" " * 80)
        return prompt

    def reward(self, prompt, completion_token_ids):
        if self.flaky(completion_token_ids):
            raise ValueError(f"flaky reward for {prompt.task_id}")
        return super().reward(prompt, completion_token_ids)


def small_config(run_dir: Path, *extra: str, steps: int = STEPS):
    return load_config(DEMO, [
        f"--run.dir={run_dir}", "--train.sft_steps=5", "--train.sft_batch=32", f"--train.steps={steps}",
        "--train.batch_groups=4", "--train.max_staleness=4", f"--rollout.group_size={GROUP}",
        "--rollout.max_new_tokens=48", "--rollout.max_seq_len=64", "--task.options.max_operand=999",
        "--rollout.heartbeat_s=0.5", "--rollout.heartbeat_timeout_s=10", "--rollout.grace_s=10",
        "--run.plots=false", "--run.tensorboard=false", *extra])  # what these tests never look at: ~1 s a run


class Captured:
    """What the controller (this process) saw: groups built into samples, hand-backs, finished groups."""

    def __init__(self) -> None:
        self.groups: list = []  # GroupResult handed to the SampleBuilder, in order
        self.handbacks: list = []  # (task_id, worker_id, partials) of hand-backs the queue accepted
        self.finished: dict = {}  # task_id -> (worker_id, policy version when first seen, its oldest token's)
        self.fails: list = []  # (task_id, error, outcome) of every failed generation reported


@pytest.fixture
def captured(monkeypatch) -> Captured:
    from moerl.loop.controller import Controller
    from moerl.loop.samples import SampleBuilder
    from moerl.loop.work_queue import WorkQueue

    seen = Captured()
    build, hand_back, take_batch = SampleBuilder.build, WorkQueue.hand_back, Controller._take_batch
    fail = WorkQueue.fail

    def build_spy(self, batch, step, version):
        seen.groups.extend(batch)
        return build(self, batch, step, version)

    def hand_back_spy(self, task_id, worker_id, partials, now):
        ok = hand_back(self, task_id, worker_id, partials, now)
        if ok:
            seen.handbacks.append((task_id, worker_id, list(partials)))
        return ok

    def take_batch_spy(self):
        for g in self.state.ready:
            oldest = min((min(c.versions) for c in g.completions if c.versions), default=self.state.version)
            seen.finished.setdefault(g.task_id, (g.worker_id, self.state.version, oldest))
        return take_batch(self)

    def fail_spy(self, task_id, worker_id, error, now):
        outcome = fail(self, task_id, worker_id, error, now)
        seen.fails.append((task_id, error, outcome))
        return outcome

    monkeypatch.setattr(WorkQueue, "fail", fail_spy)
    monkeypatch.setattr(SampleBuilder, "build", build_spy)
    monkeypatch.setattr(WorkQueue, "hand_back", hand_back_spy)
    monkeypatch.setattr(Controller, "_take_batch", take_batch_spy)
    return seen


def last_step(run_dir: Path) -> int:
    rows = read_jsonl(run_dir / "metrics.jsonl", missing_ok=True)
    return max((int(r["step"]) for r in rows), default=-10**9)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


class Striker(threading.Thread):
    """Waits for RL step `at_step`, then signals rollout workers while they have requests in flight: the
    first of `actors`, and the next ones (each once its predecessor is gone) until `enough()` holds."""

    def __init__(self, run_dir: Path, sig: int, actors=("RolloutWorker-rollout-0",), at_step: int = 2,
                 deadline_s: float = 150.0, exit_within_s: float = 0.0, enough=lambda: True) -> None:
        super().__init__(daemon=True, name=f"striker-{sig}")
        self.run_dir, self.sig, self.actors, self.at_step = run_dir, sig, actors, at_step
        self.deadline = time.monotonic() + deadline_s
        self.exit_within_s, self.enough = exit_within_s, enough
        self.stop = threading.Event()
        self.struck: list[dict] = []  # the worker's ping answer just before the signal, + "exit_s"
        self.error: BaseException | None = None

    @property
    def pid(self) -> int:
        return self.struck[0]["pid"]

    @property
    def worker_id(self) -> str:
        return self.struck[0]["worker_id"]

    def _wait(self, what: str) -> None:
        if self.stop.is_set() or time.monotonic() > self.deadline:
            raise TimeoutError(f"striker gave up waiting for {what}")
        time.sleep(0.02)

    def _busy(self, actor: str) -> dict:
        import ray

        while True:
            try:
                info = ray.get(ray.get_actor(actor).ping.remote(), timeout=10)
                if info["in_flight"] > 0:  # strike while the worker is generating
                    return info
            except (ValueError, ray.exceptions.RayError):
                pass  # not (yet) registered
            self._wait(f"actor {actor} with requests in flight")

    def run(self) -> None:
        try:
            while last_step(self.run_dir) < self.at_step:
                self._wait(f"RL step {self.at_step} in metrics.jsonl")
            for actor in self.actors:
                info = self._busy(actor)
                t0 = time.monotonic()
                os.kill(info["pid"], self.sig)
                self.struck.append({**info, "exit_s": None})  # seconds from the signal until the process was gone
                if self.exit_within_s:
                    while pid_alive(info["pid"]) and time.monotonic() - t0 < self.exit_within_s + 30:
                        time.sleep(0.05)
                    self.struck[-1]["exit_s"] = None if pid_alive(info["pid"]) else time.monotonic() - t0
                if self.enough():
                    return
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def run_with_striker(cfg, striker: Striker) -> dict:
    import ray

    from moerl.run import train

    real_shutdown = ray.shutdown

    def shutdown_after_striker(*args, **kwargs):
        # The striker's Ray calls end before Ray does: a call racing ray.shutdown() meets a destroyed core worker,
        # and Ray then ends this whole process with _exit(1) (pytest's summary lost; CI saw it once).
        striker.stop.set()
        striker.join(timeout=60)
        real_shutdown(*args, **kwargs)

    ray.shutdown = shutdown_after_striker
    striker.start()
    try:
        result = train(cfg)
    finally:
        ray.shutdown = real_shutdown
        striker.stop.set()
        striker.join(timeout=60)
    assert not striker.is_alive()
    assert striker.error is None, f"striker failed: {striker.error!r}"
    return result


def check_trained_once(run_dir: Path, result: dict, groups: list, steps: int) -> list[dict]:
    """The run is complete and no sample was trained twice; returns the trajectory rows."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics if r["step"] > 0] == list(range(1, steps + 1))
    rows = read_jsonl(run_dir / "trajectories.jsonl")
    keys = Counter((r["task_id"], r["sample_index"]) for r in rows)
    assert max(keys.values()) == 1, f"trained twice: {[k for k, n in keys.items() if n > 1]}"
    per_task = Counter(r["task_id"] for r in rows)
    failed_in = {g.task_id: sum(r is None for r in g.rewards) for g in groups}
    assert groups and Counter(g.task_id for g in groups).most_common(1)[0][1] == 1, "a group trained twice"
    for tid, n in per_task.items():
        assert n == GROUP - failed_in[tid], f"{tid}: {n} rows for group_size {GROUP}, {failed_in[tid]} failed"
    assert len(rows) == result["counters"]["samples_trained"]
    assert result["failed_tasks"] == []
    assert all(r["versions"][0] >= 0 for r in rows), "trained a sample generated before any weights arrived"
    return rows


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shared", "object_store", "broadcast"])
def test_sigkill_worker_mid_run(tmp_path, shared_ray, captured, transport):
    # One worker: the run can only finish through its replacement, so the replacement's start and first groups
    # are part of every run (with two, a fast run could end before the replacement came up). Every transport:
    # shared (the /dev/shm twin of CUDA IPC: the replacement maps the trainer's buffers anew; "auto" would pick the
    # object store on a CPU, and this parameter was "auto" until it was seen to repeat the next one),
    # the object store, and gloo's twin of NCCL's broadcast, where the kill breaks the group's collective, the
    # trainer's send fails within its timeout on its own thread, training goes on, and the next publish forms a
    # group with the replacement.
    cfg = small_config(tmp_path, "--rollout.num_workers=1", f"--weights.transport={transport}",
                       "--weights.timeout_s=5", steps=RUN_STEPS)
    striker = Striker(tmp_path, signal.SIGKILL)
    result = run_with_striker(cfg, striker)
    print(f"SIGKILL {striker.worker_id} pid {striker.pid}: {result['counters']} queue {result['queue']} "
          f"weights {result['weights']}")

    assert result["counters"]["workers_lost"] >= 1 and result["queue"]["lost"] >= 1
    assert not pid_alive(striker.pid)
    # small_config turns run.plots and run.tensorboard off: neither writes (test_eval_ray's run has them on)
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "tensorboard").exists()
    m = result["metrics"]
    assert m["workers/alive"] == m["workers/target"] == cfg.rollout.num_workers, "no replacement came up"
    check_trained_once(tmp_path, result, captured.groups, cfg.train.steps)
    # The replacement took work, and joined with the newest weights (not the ones of when it was spawned).
    first = {"rollout-0"}
    new = [(v, oldest) for w, v, oldest in captured.finished.values() if w not in first]
    assert new, "the replacement finished no group"
    # Its oldest tokens are at least as new as the weights the killed worker held when it died: it was
    # brought up to date before it took work. (Not "within max_staleness when first seen": a first group on a
    # cold worker may take several trainer steps and is then dropped as stale, which is the gate working.)
    killed_at = striker.struck[0]["version"]
    assert all(oldest >= killed_at for _, oldest in new), (killed_at, new)
    if transport == "shared":  # the weights did travel through the trainer's shared buffers
        assert result["weights"]["shared_publishes"] >= cfg.train.steps, result["weights"]
    if transport == "broadcast":  # the replacement was sent weights by a group of its own
        assert result["weights"]["broadcast_generations"] >= 2, result["weights"]


@pytest.mark.timeout(150)
def test_sigterm_worker_hands_back_and_exits(tmp_path, shared_ray, captured):
    groups, handbacks = captured.groups, captured.handbacks
    cfg = small_config(tmp_path, steps=RUN_STEPS)

    def partial_tokens(parts) -> bool:
        return any(p is not None and p.token_ids and p.finish_reason == "abort" for p in parts)

    # A worker that happens to be between two groups when SIGTERM lands has nothing to hand back; then
    # the other one is preempted too (once the first is gone), so that token continuation is exercised.
    striker = Striker(tmp_path, signal.SIGTERM, actors=("RolloutWorker-rollout-0", "RolloutWorker-rollout-1"),
                      exit_within_s=cfg.rollout.grace_s, enough=lambda: any(partial_tokens(p) for *_, p in handbacks))
    result = run_with_striker(cfg, striker)
    print(f"SIGTERM {striker.struck}: {result['counters']} queue {result['queue']}; partial tokens handed back "
          f"{[[p and len(p.token_ids) for p in parts] for _, _, parts in handbacks]}")

    struck = {s["worker_id"] for s in striker.struck}
    assert result["counters"]["preempted"] >= 1 and result["queue"]["handed_back"] >= 1
    for s in striker.struck:
        assert s["exit_s"] is not None and s["exit_s"] <= cfg.rollout.grace_s + 2.5, \
            f"preempted {s['worker_id']} took {s['exit_s']} s to exit (grace {cfg.rollout.grace_s} s)"
    rows = check_trained_once(tmp_path, result, groups, cfg.train.steps)

    # Token continuation: a handed-back partial with tokens was finished by another worker, keeping its
    # tokens, log-probs, versions and routing; every token of the finished completion has a log-prob and a version.
    assert {w for _, w, _ in handbacks} <= struck
    last_handback = {tid: (w, parts) for tid, w, parts in handbacks}
    partial_by_task = {tid: (w, parts) for tid, (w, parts) in last_handback.items() if partial_tokens(parts)}
    assert partial_by_task, "the preempted workers handed back no partial tokens"
    continued = [g for g in groups if g.task_id in partial_by_task]
    assert continued, "no handed-back group was trained"
    for g in continued:
        by, parts = partial_by_task[g.task_id]
        assert g.worker_id != by, "continued by the worker that handed it back"
        for p, c in zip(parts, g.completions):
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions)
            assert c.routed_experts.shape[0] == len(c.prompt_token_ids) + len(c.token_ids) - 1
            if p is not None:
                n = len(p.token_ids)
                assert c.token_ids[:n] == p.token_ids and c.logprobs[:n] == p.logprobs
                assert c.versions[:n] == p.versions
                assert torch.equal(c.routed_experts[: p.routed_experts.shape[0]], p.routed_experts)
    assert {r["task_id"] for r in rows} & set(partial_by_task)


@pytest.mark.timeout(150)
def test_hung_worker_misses_its_heartbeat(tmp_path, shared_ray, captured):
    """SIGSTOP: the worker neither answers nor dies; past heartbeat_timeout_s it is lost, its leases go back,
    and the pool kills and replaces it. One worker: the run cannot finish before the hung one is declared lost
    (with a second worker a fast run could end first, and the test would depend on timing)."""
    cfg = small_config(tmp_path, "--rollout.heartbeat_timeout_s=3", "--rollout.num_workers=1", steps=RUN_STEPS)
    striker = Striker(tmp_path, signal.SIGSTOP)
    try:
        result = run_with_striker(cfg, striker)
        print(f"SIGSTOP {striker.worker_id} pid {striker.pid}: {result['counters']} queue {result['queue']}")
        assert result["counters"]["workers_lost"] >= 1 and result["queue"]["lost"] >= 1
        check_trained_once(tmp_path, result, captured.groups, cfg.train.steps)
        assert not any(g.worker_id == striker.worker_id for g in captured.groups[-8:])
        wait_for(lambda: not pid_alive(striker.pid), 30, "the hung worker to be killed")
    finally:
        if striker.struck and pid_alive(striker.pid):
            os.kill(striker.pid, signal.SIGKILL)


@pytest.mark.timeout(150)
def test_reward_that_raises_and_generation_that_fails(tmp_path, shared_ray, captured):
    """A reward that raises fails that sample only (never a zero reward); a group whose generation fails is
    retried up to rollout.max_attempts and then recorded as failed, never trained."""
    groups = captured.groups
    cfg = small_config(tmp_path, f"--task.name={FLAKY}", "--rollout.max_attempts=2", steps=6)
    from moerl.run import train

    result = train(cfg)
    print(f"flaky: {result['counters']} queue {result['queue']} failed {result['failed_tasks']}")
    failed = [(g, i) for g in groups for i, r in enumerate(g.rewards) if r is None]
    assert result["counters"]["samples_failed"] == len(failed) > 0
    for g, i in failed:
        assert FlakyTask.flaky(g.completions[i].token_ids)
        assert g.reward_errors[i] == f"ValueError: flaky reward for {g.task_id}"
    for g in groups:  # the subset that raised is exactly the failed one: never a zero reward instead
        assert [r is None for r in g.rewards] == [FlakyTask.flaky(c.token_ids) for c in g.completions]
        assert not FlakyTask.unplayable(g.task_id)
    rows = read_jsonl(tmp_path / "trajectories.jsonl")
    trained = {(r["task_id"], r["sample_index"]) for r in rows}
    assert not trained & {(g.task_id, i) for g, i in failed}, "a failed sample was trained"
    assert len(rows) == result["counters"]["samples_trained"] == GROUP * len(groups) - len(failed)

    # Failed generations: each unplayable group twice (max_attempts=2), then failed; nothing else failed.
    assert result["failed_tasks"] and all(FlakyTask.unplayable(t) for t in result["failed_tasks"])
    assert result["counters"]["groups_failed"] == len(result["failed_tasks"]) == result["queue"]["failed"]
    assert all(FlakyTask.unplayable(t) for t, _, _ in captured.fails)
    assert all("leaves no room to generate" in e for _, e, _ in captured.fails), captured.fails[0]
    outcomes = Counter((t, o) for t, _, o in captured.fails)
    for t in result["failed_tasks"]:
        assert outcomes[(t, "retry")] == 1 and outcomes[(t, "failed")] == 1
    assert not {r["task_id"] for r in rows} & set(result["failed_tasks"])


@pytest.mark.timeout(150)
def test_task_module_that_fails_to_import(tmp_path, own_ray, monkeypatch):
    import ray

    from moerl.run import train
    from moerl.tasks.base import TaskError

    (tmp_path / "broken_task_mod.py").write_text("import moerl_no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, needle in [("tests.integration.no_such_task_module:Task", "no_such_task_module"),
                         ("broken_task_mod:Task", "moerl_no_such_dependency_xyz"),
                         ("moerl.tasks.arithmetic:NoSuchTask", "NoSuchTask")]:
        cfg = small_config(tmp_path / "run", f"--task.name={name}")
        t0 = time.monotonic()
        with pytest.raises(TaskError) as info:
            train(cfg)
        assert f"cannot load task {name!r}" in str(info.value) and needle in str(info.value)
        assert time.monotonic() - t0 < 10
        assert not ray.is_initialized(), "Ray was started before the task was checked"


class HangingTask(ArithmeticTask):
    """Arithmetic whose constructor never returns inside a Ray actor (a worker that can never start: a model
    download that hangs, a dead filesystem); the driver builds it normally."""

    def __init__(self, *args, **kwargs) -> None:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            time.sleep(3600)
        super().__init__(*args, **kwargs)


@pytest.mark.timeout(150)
def test_workers_that_never_start_end_the_run(tmp_path, own_ray):
    """Each worker stuck in its constructor past rollout.start_timeout_s counts as a failed start; three in a
    row end the run with the reason (they used to be respawned forever)."""
    from moerl.run import train

    cfg = small_config(tmp_path, "--task.name=tests.integration.test_rl_faults:HangingTask",
                       "--rollout.num_workers=1", "--rollout.start_timeout_s=3", "--rollout.heartbeat_s=0.5",
                       "--rollout.respawn_backoff_s=0", "--train.sft_steps=0")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        train(cfg)
    message = str(info.value)
    assert "3 rollout workers in a row failed to start" in message and "rollout.start_timeout_s" in message, message
    assert time.monotonic() - t0 < 120


@pytest.mark.timeout(150)
def test_task_that_fails_to_import_on_the_workers_only(tmp_path, shared_ray, monkeypatch):
    """The driver imports the task but the workers cannot (their environment lacks it): a clear error, no
    endless respawning of workers that die in their constructor."""
    from moerl.run import train

    (tmp_path / "driver_only_task.py").write_text(
        "from moerl.tasks.arithmetic import ArithmeticTask as DriverOnlyTask\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver's sys.path only: not the workers'
    cfg = small_config(tmp_path / "run", "--task.name=driver_only_task:DriverOnlyTask")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        train(cfg)
    message = str(info.value)
    print(message)
    assert "driver_only_task:DriverOnlyTask" in message and "rollout worker" in message, message
    assert time.monotonic() - t0 < 90


# ------------------------------------------------------------------------------------------ worker class
class _IMDS(http.server.ThreadingHTTPServer):
    """A fake EC2 instance metadata service: no spot notice (404) until `notice` is set."""

    def __init__(self) -> None:
        self.notice = threading.Event()
        self.tokens_issued = 0
        self.authorized_gets = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_PUT(self) -> None:  # noqa: N802
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    server.tokens_issued += 1
                    self._reply(200, b"test-token")
                else:
                    self._reply(400, b"")

            def do_GET(self) -> None:  # noqa: N802
                if self.path != "/latest/meta-data/spot/instance-action":
                    return self._reply(404, b"")
                if self.headers.get("X-aws-ec2-metadata-token") != "test-token":
                    return self._reply(401, b"")
                server.authorized_gets += 1
                if server.notice.is_set():
                    body = json.dumps({"action": "terminate", "time": "2030-01-01T00:00:00Z"}).encode()
                    return self._reply(200, body)
                self._reply(404, b"")

            def _reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/latest/meta-data/spot/instance-action"


def tiny_worker_spec(**changes):
    from moerl.model import tiny_config
    from moerl.actors.worker_spec import WorkerSpec
    from moerl.rollout import EngineConfig, SamplingParams

    task = ArithmeticTask()
    arch = tiny_config(vocab_size=task.tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                       eos_token_id=task.tokenizer.eos_token_id, max_position_embeddings=256)
    # No stop token: every request runs its max_new_tokens, so it is surely in flight when preempted.
    spec = WorkerSpec(arch=arch.to_hf_dict(), model_path="", dtype="float32", device="cpu",
                      engine=EngineConfig(max_batch_size=8, max_seq_len=256), sampling=SamplingParams(
                          max_new_tokens=200, temperature=1.0, stop_token_ids=[]),
                      task_name="moerl.tasks.arithmetic:ArithmeticTask", task_options={}, seed=0,
                      grace_s=1.0, imds_interval_s=0.1)
    return replace(spec, **changes)


@pytest.fixture
def in_process_workers(monkeypatch):
    """RolloutWorker objects built in this process (no Ray); `os._exit` is caught instead of run."""
    from moerl.actors import rollout_worker

    exits: list[int] = []
    exited = threading.Event()

    def fake_exit(code: int) -> None:
        exits.append(code)
        exited.set()

    monkeypatch.setattr(rollout_worker.os, "_exit", fake_exit)
    sigterm, threads = signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    workers = []

    def make(worker_id: str, spec):
        w = rollout_worker.RolloutWorker(worker_id, spec)
        workers.append(w)
        return w

    yield make, exited, exits
    for w in workers:
        if w.preempting.is_set():  # its exit thread must call the fake before the real one is restored
            assert exited.wait(w.spec.grace_s + 5), "the preempted worker never exited"
        w.engine.stop()
    signal.signal(signal.SIGTERM, sigterm)
    torch.set_num_threads(threads)


def group_task(task_id: str = "arith-000007", index: int = 7, group_size: int = 3):
    from moerl.loop.types import GroupTask

    prompt = ArithmeticTask().prompt_at(index)
    return GroupTask(task_id, index, prompt.prompt_token_ids, group_size)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


@pytest.mark.timeout(150)
def test_imds_notice_preempts_and_partials_continue_elsewhere(in_process_workers):
    from moerl.actors.worker_spec import WorkerSpec

    assert WorkerSpec.imds_interval_s == 5.0  # the spot notice is polled every 5 s unless a spec says otherwise
    make, exited, exits = in_process_workers
    imds = _IMDS()
    threading.Thread(target=imds.serve_forever, daemon=True, name="fake-imds").start()
    try:
        a = make("rollout-a", tiny_worker_spec(imds_url=imds.url))
        wait_for(lambda: imds.authorized_gets >= 2, 10, "the worker to poll IMDS (with an IMDSv2 token)")
        assert imds.tokens_issued >= 2 and not a.preempting.is_set()

        task = group_task()
        out: dict = {}
        runner = threading.Thread(target=lambda: out.setdefault("result", a.run_group(task)), daemon=True)
        runner.start()
        wait_for(lambda: a.engine.in_flight == task.group_size and a.engine.engine.stats["decode_steps"] >= 5,
                 30, "generation in flight")
        # Hold the engine between two steps (a command that blocks), so the notice surely lands mid-generation.
        gate = threading.Event()
        threading.Thread(target=a.engine.call, args=(lambda engine: gate.wait(30),), daemon=True).start()
        imds.notice.set()
        wait_for(a.preempting.is_set, 5 * a.spec.imds_interval_s + 5, "the IMDS notice to preempt the worker")
        gate.set()
        runner.join(timeout=30)
        assert not runner.is_alive()
        result = out["result"]
        assert result.status == "preempted" and len(result.completions) == task.group_size
        assert all(c.finish_reason == "abort" for c in result.completions)
        assert any(c.token_ids for c in result.completions), "aborted before any token"
        for c in result.completions:
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) < 200

        # A preempting worker takes no new work, and exits (os._exit(0)) once nothing is in flight.
        late = a.run_group(group_task("arith-000008", 8))
        assert late.status == "preempted" and late.completions == [None] * 3
        assert exited.wait(a.spec.grace_s + 5) and exits == [0]
    finally:
        imds.shutdown()
        imds.server_close()

    # Another worker continues the partials by token continuation: same prefix, same per-token data.
    b = make("rollout-b", tiny_worker_spec())
    task.partials = list(result.completions)
    done = b.run_group(task)
    assert done.status == "ok", done.error
    for p, c in zip(task.partials, done.completions):
        n = len(p.token_ids)
        assert c.token_ids[:n] == p.token_ids and c.logprobs[:n] == p.logprobs and c.versions[:n] == p.versions
        assert len(c.token_ids) == 200 == len(c.logprobs) == len(c.versions)
        assert c.routed_experts.shape[0] == len(c.prompt_token_ids) + 199
        assert torch.equal(c.routed_experts[: p.routed_experts.shape[0]], p.routed_experts)
    assert all(r is not None for r in done.rewards)


@pytest.mark.timeout(150)
def test_sigterm_handler_on_worker_class(in_process_workers):
    """The constructor installs the SIGTERM handler (main thread); SIGTERM preempts instead of killing."""
    make, exited, exits = in_process_workers
    before = signal.getsignal(signal.SIGTERM)
    w = make("rollout-s", tiny_worker_spec())
    assert signal.getsignal(signal.SIGTERM) is not before, "no SIGTERM handler installed"
    os.kill(os.getpid(), signal.SIGTERM)
    wait_for(w.preempting.is_set, 5, "SIGTERM to preempt the worker")
    assert exited.wait(w.spec.grace_s + 5) and exits == [0]


@pytest.mark.timeout(60)
def test_dead_engine_thread_fails_pings_groups_and_updates_at_once(in_process_workers):
    """A worker whose engine thread died used to answer pings (renewing its leases), fail its groups only after
    group_timeout_s with an empty TimeoutError, and never return from update_weights. Now: the ping raises (the
    pool replaces it and its leases go back), and groups and weight updates fail at once with the cause."""
    make, _, _ = in_process_workers
    w = make("rollout-z", tiny_worker_spec(group_timeout_s=600.0))
    assert w.ping()["stalled_s"] == 0.0

    def crash(*_args, **_kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    w.engine.engine.step = crash
    t0 = time.monotonic()
    first = w.run_group(group_task())  # its requests crash the engine thread
    assert first.status == "error" and "illegal memory access" in first.error, first
    with pytest.raises(RuntimeError, match="engine thread died: RuntimeError: CUDA error"):
        w.ping()
    second = w.run_group(group_task("arith-000008", 8))  # submitted after the crash
    assert second.status == "error" and "engine thread died" in second.error, second
    with pytest.raises(RuntimeError, match="engine thread died"):
        w.update_weights(5, [])
    assert time.monotonic() - t0 < 30  # not group_timeout_s


@pytest.mark.timeout(60)
def test_engine_stuck_in_a_step_reports_its_stall(in_process_workers):
    """Health comes from the engine's progress: an engine stuck in one step shows a growing `stalled_s` in its
    pings (the pool replaces it past rollout.heartbeat_timeout_s), while an idle one shows 0."""
    make, _, _ = in_process_workers
    w = make("rollout-h", tiny_worker_spec())
    release, entered = threading.Event(), threading.Event()
    step = w.engine.engine.step

    def stuck():
        entered.set()
        release.wait(30)
        return step()

    w.engine.engine.step = stuck
    fut = w.engine.submit([1, 2, 3], w.spec.sampling, "stuck-0")
    wait_for(entered.is_set, 10, "the engine to enter its step")
    wait_for(lambda: w.ping()["stalled_s"] > 0.5, 10, "the stall to show in the ping")
    release.set()
    w.engine.engine.step = step
    w.engine.abort_all()
    fut.result(timeout=30)


def _descends_from_us(pid: int) -> bool:
    """Is `pid` under this process (our own local Ray: its raylet is our child, its workers the raylet's)?"""
    for _ in range(16):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            return False
        if pid == os.getpid():
            return True
        if pid <= 1:
            return False
    return False


def _trainer_pids() -> list[int]:
    """This run's processes whose title Ray set to a TrainerRank actor's (`ray::TrainerRank...`)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::TrainerRank") and _descends_from_us(int(entry)):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


@pytest.mark.timeout(150)
def test_trainer_death_names_the_rank_and_how_to_resume(tmp_path, shared_ray, capsys):
    """A trainer rank killed mid-run ends the run with one line naming the rank and the checkpoint to resume
    from (it used to be a raw ActorDiedError)."""
    from moerl.train_cli import main

    overrides = [f"--run.dir={tmp_path}", "--train.sft_steps=0", "--train.steps=200", "--train.batch_groups=2",
                 f"--rollout.group_size={GROUP}", "--rollout.num_workers=1", "--checkpoint.every=2"]
    killed: list[int] = []

    def strike() -> None:  # once a checkpoint is committed (its save is asynchronous: wait for the commit)
        from moerl.checkpoint import CheckpointStore

        store, deadline = CheckpointStore(str(tmp_path / "checkpoints")), time.monotonic() + 100
        while (last_step(tmp_path) < 3 or store.latest_step() is None) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = _trainer_pids()
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    striker = threading.Thread(target=strike, daemon=True)
    striker.start()
    code = main([str(DEMO), *overrides])
    striker.join(timeout=10)
    captured = capsys.readouterr()
    out = captured.out + captured.err  # the error line is on stderr
    assert killed and code == 1, out
    line = [x for x in captured.err.splitlines() if x.startswith("error:")][-1]
    assert "trainer rank 0 died" in line and "newest committed checkpoint is step" in line and "--resume" in line, line
