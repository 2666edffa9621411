"""The rollout worker: one engine, generates and scores prompt groups, hands work back on preemption.

Runs as a threaded Ray actor named `RolloutWorker` (see pools.py): `__init__` runs on the process's main
thread, where the SIGTERM handler goes (Kubernetes sends SIGTERM on a spot drain); an optional thread polls
the EC2 IMDS `spot/instance-action` notice every 5 s. On either, the worker stops taking groups, aborts its
in-flight requests, returns their partial completions (status "preempted") so the controller re-queues them
for continuation elsewhere, and exits once they are handed back (at most `grace_s` later).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import threading
import time
import urllib.parse
import urllib.request
from typing import Any

import torch

from moerl.actors import weight_sync
from moerl.actors.engine_ranks import start_engine_group
from moerl.actors.engine_thread import EngineThread
from moerl.actors.episodes import run_episode_group
from moerl.actors.eval_runner import EvalRunner
from moerl.actors.worker_spec import WorkerSpec, rollout_model
from moerl.loop.evaluation import EvalRequest, EvalResult
from moerl.loop.types import GroupResult, GroupTask
from moerl.model import build_model, load_pretrained
from moerl.model.config import MoEModelConfig
from moerl.rollout import Engine
from moerl.rollout.group_leader import GroupLeader
from moerl.rollout.memory import plan_for_device
from moerl.tasks.base import load_task
from moerl.tasks.episodic import is_episodic
from moerl.tasks.scoring import RewardScorer


def _build_engine(spec: WorkerSpec, arch: MoEModelConfig, dtype: torch.dtype) -> Engine | GroupLeader:
    if spec.ep_size > 1:
        return start_engine_group(spec)
    if spec.model_path:
        model = load_pretrained(spec.model_path, dtype=dtype, device=spec.device)
    else:
        model = build_model(arch, dtype=dtype, device=spec.device, seed=spec.seed)
    return Engine(rollout_model(model, spec), spec.engine, version=-1)


def sample_seed(run_seed: int, task_id: str, index: int) -> int:
    """A stable per-sample seed: a continuation on another worker draws the same noise."""
    digest = hashlib.blake2b(f"{run_seed}/{task_id}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class RolloutWorker:
    def __init__(self, worker_id: str, spec: WorkerSpec) -> None:
        torch.set_num_threads(spec.threads)
        if spec.engine.deterministic:  # run.deterministic: as in the trainer ranks
            torch.use_deterministic_algorithms(True)
        self.worker_id, self.spec = worker_id, spec
        dtype = getattr(torch, spec.dtype)
        arch = MoEModelConfig.from_hf_dict(spec.arch)
        self.engine = EngineThread(self.build_engine(spec, arch, dtype))
        self.receiver = weight_sync.Receiver(self.engine.engine.device)
        self.task = load_task(spec.task_name, spec.task_options, seed=spec.seed)
        self.scorer = RewardScorer(self.task, spec.reward_timeout_s)  # a hung reward fails its sample, not the worker
        self.preempting = threading.Event()
        self._inflight_groups = 0
        self._apply_s = 0.0  # engine paused for new weights since the last result handed out
        self._lock = threading.Lock()
        self._eval: EvalRunner | None = None  # built at the first eval chunk
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.preempt("SIGTERM"))
            # A local Ray's processes start with SIGTERM blocked (moerl/startup.py: a process group's SIGTERM is
            # the driver's, and a worker is in a process group of its own); one sent to this worker is its
            # preemption notice (a spot drain forwards it), as on a node of its own.
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if spec.imds_url:
            threading.Thread(target=self._poll_imds, daemon=True, name="moerl-imds").start()

    def build_engine(self, spec: WorkerSpec, arch: MoEModelConfig, dtype: torch.dtype) -> Engine | GroupLeader:
        """The worker's engine; `moerl bench ray-fleet` puts a stub engine here (moerl/bench/ray_fleet.py)."""
        # The memory plan, before any weight loads: one line, or one clear error when the weights cannot fit.
        print(f"rollout worker {self.worker_id}: {plan_for_device(arch, spec.engine, dtype, spec.device).describe()}",
              flush=True)
        return _build_engine(spec, arch, dtype)

    # ---------------------------------------------------------------- work
    def run_group(self, task: GroupTask) -> GroupResult:
        t0 = time.perf_counter()
        with self._lock:  # counted before the check: the exit thread waits for every group that passed it
            self._inflight_groups += 1
        try:
            if self.preempting.is_set():
                return GroupResult(task.task_id, task.prompt_index, self.worker_id, "preempted", list(task.partials))
            result = self._run_group(task, t0)
            with self._lock:  # the engine's weight-apply pauses since the last result, reported once
                result.apply_s, self._apply_s = self._apply_s, 0.0
            return result
        except BaseException as e:  # noqa: BLE001 - reported, retried; task code may even raise SystemExit
            return GroupResult(task.task_id, task.prompt_index, self.worker_id, "error",
                               error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
        finally:
            with self._lock:
                self._inflight_groups -= 1

    def _run_group(self, task: GroupTask, t0: float) -> GroupResult:
        if is_episodic(self.task):  # multi-turn: the environment scores each episode
            return run_episode_group(task, episodic=self.task, engine=self.engine, sampling=self.spec.sampling,
                                     seed_of=lambda i: sample_seed(self.spec.seed, task.task_id, i),
                                     limits=self.spec.episode_limits, preempting=self.preempting,
                                     timeout_s=self.spec.group_timeout_s, worker_id=self.worker_id)
        futures = []
        for i in range(task.group_size):
            partial = task.partials[i] if i < len(task.partials) else None
            if partial is not None and partial.finish_reason in ("stop", "length"):
                futures.append(None)  # finished before the preemption: nothing left to generate
                continue
            params = dataclasses.replace(self.spec.sampling, seed=sample_seed(self.spec.seed, task.task_id, i))
            futures.append(self.engine.submit(task.prompt_token_ids, params, f"{task.task_id}/{i}/{time.monotonic_ns()}",
                                              prefix=partial))
        if self.preempting.is_set():  # preempted while submitting: abort these too (queued after the first abort)
            self.engine.abort_all()
        completions = []
        for i, fut in enumerate(futures):
            completions.append(task.partials[i] if fut is None else fut.result(timeout=self.spec.group_timeout_s))
        if any(c.finish_reason == "abort" for c in completions):
            return GroupResult(task.task_id, task.prompt_index, self.worker_id, "preempted", completions,
                               seconds=time.perf_counter() - t0)
        prompt = self.task.prompt_at(task.prompt_index)
        scored = self.scorer.score(prompt, [c.token_ids for c in completions])
        rewards, errors = [r for r, _ in scored], [e for _, e in scored]
        return GroupResult(task.task_id, task.prompt_index, self.worker_id, "ok", completions, rewards, errors,
                           seconds=time.perf_counter() - t0)

    def run_eval(self, request: EvalRequest) -> EvalResult:
        """One eval chunk at the weights the controller holds this worker at (moerl/actors/eval_runner.py)."""
        t0 = time.perf_counter()
        with self._lock:  # handed back like a group before a preempted worker exits
            self._inflight_groups += 1
        try:
            if self._eval is None:
                self._eval = EvalRunner(self.worker_id, self.engine, self.task, self.spec.task_name,
                                        self.spec.task_options, self.spec.sampling, self.spec.seed,
                                        self.spec.group_timeout_s, self.spec.reward_timeout_s)
            return self._eval.run(request, self.preempting)
        except Exception as e:  # noqa: BLE001 - reported; the controller retries the chunk
            return EvalResult(request.eval_id, request.chunk, self.worker_id, "error",
                              error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
        finally:
            with self._lock:
                self._inflight_groups -= 1

    def update_weights(self, version: int, shards: list[Any]) -> int:
        """Load published weights (moerl/actors/weight_sync); returns the version the engine holds."""
        def apply(engine: Engine) -> int:
            if version > engine.version:  # calls of a threaded actor may run out of order: never go back
                t0 = time.perf_counter()
                if isinstance(engine, GroupLeader):  # every rank applies, keeping its own experts
                    engine.on_every_rank(weight_sync.apply_weights, tensors, version)
                else:
                    weight_sync.apply_weights(engine, tensors, version)
                if engine.device.type == "cuda":  # the copies are queued on the device: time them, not their launch
                    torch.cuda.synchronize(engine.device)
                with self._lock:
                    self._apply_s += time.perf_counter() - t0
            return engine.version
        with self.receiver.lock:  # receive and apply, one version at a time
            tensors = self.receiver.receive(shards)
            return self.engine.call(apply)

    def ping(self) -> dict:
        """Liveness from the engine's progress, not from this thread: a dead engine thread fails the ping, so the
        worker is replaced and its leases go back at once (else it answered pings and held its groups)."""
        if (dead := self.engine.dead()) is not None:
            raise dead
        return {"worker_id": self.worker_id, "pid": os.getpid(), "version": self.engine.engine.version,
                "stalled_s": self.engine.stalled_s(),
                "where": weight_sync.Location.here(self.engine.engine.device),
                "in_flight": self.engine.in_flight, "preempting": self.preempting.is_set(),
                "stats": dict(self.engine.engine.stats)}

    # ---------------------------------------------------------------- preemption
    def preempt(self, reason: str = "preempt") -> None:
        """Stop taking work, abort in-flight requests (their partials go back), exit after handing back."""
        if self.preempting.is_set():
            return
        print(f"rollout worker {self.worker_id}: preempted ({reason}); handing back its work", flush=True)
        self.preempting.set()
        self.engine.abort_all()
        threading.Thread(target=self._exit_when_handed_back, daemon=True, name="moerl-exit").start()

    def _exit_when_handed_back(self) -> None:
        deadline = time.monotonic() + self.spec.grace_s
        while self._inflight_groups > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))  # let Ray deliver the last replies
        os._exit(0)

    def _poll_imds(self) -> None:
        parts = urllib.parse.urlsplit(self.spec.imds_url)
        token_url = f"{parts.scheme}://{parts.netloc}/latest/api/token"
        while not self.preempting.is_set():
            try:
                headers = {}
                try:  # IMDSv2: a session token first (EKS nodes usually require it)
                    req = urllib.request.Request(token_url, method="PUT",
                                                 headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
                    with urllib.request.urlopen(req, timeout=2) as resp:  # noqa: S310 - configured URL
                        headers["X-aws-ec2-metadata-token"] = resp.read().decode()
                except OSError:
                    pass
                with urllib.request.urlopen(urllib.request.Request(self.spec.imds_url, headers=headers),
                                            timeout=2) as resp:  # noqa: S310
                    if resp.status == 200:
                        self.preempt("IMDS spot/instance-action")
                        return
            except OSError:
                pass  # 404 (no notice) or unreachable: keep polling
            time.sleep(self.spec.imds_interval_s)
