"""`moerl train CONFIG [--dotted.key=value ...]`: the one composition root. It builds every part from the
config (task, model architecture, the Ray trainer group and rollout pool, weight sync, checkpoints, the run
log) and hands them to the loop's Controller.

    moerl train configs/demo.toml --train.steps=20 --rollout.num_workers=3

With no `ray.address` (and no RAY_ADDRESS) a local Ray instance is started on 127.0.0.1 and stopped at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moerl import local_ray, preflight
from moerl.config import MoerlConfig
from moerl.loop.episode import EpisodeLimits
from moerl.model import MoEModelConfig, read_config, read_stop_token_ids, tiny_config
from moerl.preflight import PreflightError, one_line
from moerl.ray_gc import gc_frozen
from moerl.redact import redact_config
from moerl.resume import check_config, saved_config
from moerl.resume import complete as is_complete
from moerl.resume import statement as resume_statement
from moerl.run_dir import RunLock
from moerl.rollout import EngineConfig, SamplingParams
from moerl.startup import StartupStopped, run_within
from moerl.tasks.base import Task, stop_token_ids
from moerl.train.sample import Sample


def model_architecture(cfg: MoerlConfig, task: Task) -> MoEModelConfig:
    if cfg.model.path:
        return read_config(cfg.model.path)
    presets = {  # random-init architectures for runs without a checkpoint
        "tiny": dict(hidden_size=64, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=64, intermediate_size=128),
        "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=32, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
                      intermediate_size=512),
        # the 1.65B shape of the GPU measurements (issues 14-15; 1.65B parameters at the byte vocabulary, 0.24B of
        # them active per token): hidden 1024, 16 layers, 64 experts top-8
        "medium": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                       intermediate_size=2048),
    }
    if cfg.model.preset not in presets:
        raise ValueError(f"config key 'model.preset' {cfg.model.preset!r} is unknown (known: {sorted(presets)}); "
                         "or set model.path to a Hugging Face checkpoint")
    # Exactly the tokenizer's vocabulary: a random model must not sample ids the tokenizer cannot decode.
    return tiny_config(vocab_size=task.tokenizer.vocab_size, eos_token_id=task.tokenizer.eos_token_id,
                       max_position_embeddings=cfg.rollout.max_seq_len, **presets[cfg.model.preset])


def run_stop_token_ids(cfg: MoerlConfig, task: Task) -> tuple[int, ...]:
    """What ends a completion: the tokenizer's EOS and end-of-turn tokens, and the checkpoint's
    generation_config.json `eos_token_id` (an int or a list) when the run starts from one."""
    from_checkpoint = read_stop_token_ids(cfg.model.path) if cfg.model.path else ()
    return tuple(dict.fromkeys(stop_token_ids(task.tokenizer) + from_checkpoint))


def resolve_device(cfg: MoerlConfig) -> str:
    if cfg.run.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.run.device


def _specs(cfg: MoerlConfig, arch: MoEModelConfig, task: Task):
    from moerl.actors.worker_spec import WorkerSpec
    from moerl.actors.trainer_actor import TrainerSpec

    device = resolve_device(cfg)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                              top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              stop_token_ids=run_stop_token_ids(cfg, task))
    r = cfg.rollout
    # A worker that shares its GPU (gpus_per_worker < 1, e.g. with a trainer rank) takes only its share of it.
    share = r.gpus_per_worker if 0 < r.gpus_per_worker < 1 else 1.0
    engine = EngineConfig(max_batch_size=r.max_batch_size, max_seq_len=r.max_seq_len,
                          deterministic=cfg.run.deterministic, seed=cfg.run.seed, kv_block_size=r.kv_block_size,
                          kv_cache_tokens=r.kv_cache_tokens, gpu_memory_fraction=r.gpu_memory_fraction * share,
                          prefix_caching=r.prefix_caching,
                          overlap_decode={"auto": None, "on": True, "off": False}[r.overlap_decode],
                          # a model's embedding padded past the tokenizer's ids: those are never sampled
                          vocab_limit=task.tokenizer.vocab_size if task.tokenizer.vocab_size < arch.vocab_size else 0)
    t = cfg.train
    worker = WorkerSpec(arch=arch.to_hf_dict(), model_path=cfg.model.path, dtype=cfg.model.dtype, device=device,
                        engine=engine, sampling=sampling, task_name=cfg.task.name, task_options=dict(cfg.task.options),
                        seed=cfg.run.seed, threads=cfg.rollout.threads, grace_s=cfg.rollout.grace_s,
                        imds_url=cfg.rollout.imds_url, ep_size=cfg.rollout.ep_size,
                        reward_timeout_s=cfg.task.reward_timeout_s,
                        episode_limits=EpisodeLimits(cfg.rollout.max_turns,
                                                     cfg.rollout.max_episode_tokens or cfg.rollout.max_new_tokens,
                                                     cfg.rollout.tool_timeout_s),
                        expert_bias=cfg.model.expert_bias_update_rate > 0)
    trainer = TrainerSpec(arch=arch.to_hf_dict(), model_path=cfg.model.path, dtype=cfg.model.dtype, device=device,
                          optim=t.optim, loss=t.loss, ep_size=cfg.ep.size,
                          dispatcher=cfg.model.dispatcher, routing_replay=cfg.model.routing_replay,
                          aux_loss_coef=cfg.model.router_aux_loss_coef,
                          expert_bias_rate=cfg.model.expert_bias_update_rate,
                          capacity_factor=cfg.model.capacity_factor, seed=cfg.run.seed, threads=t.threads,
                          data_parallel=t.data_parallel, collective_timeout_s=t.collective_timeout_s,
                          master_dtype=t.master_dtype, micro_batch_tokens=t.micro_batch_tokens,
                          minibatches=t.minibatches,
                          activation_checkpointing=t.activation_checkpointing, reduce_grads_once=t.reduce_grads_once,
                          temperature=cfg.rollout.temperature, deterministic=cfg.run.deterministic,
                          store_host="" if _joins_cluster(cfg) else "127.0.0.1")
    return worker, trainer


def warm_start(trainer, task: Task, cfg: MoerlConfig, log, stop: Callable[[], bool] = lambda: False) -> bool:
    """Supervised steps on the task's reference answers, so RL starts from a policy that knows the format.
    `log(i, metrics)` hears of each step, i from 0. Returns False when `stop` cut it short (the run then ends
    without a checkpoint: nothing RL-trained yet)."""
    if cfg.train.sft_steps == 0:
        return True
    if not hasattr(task, "sft_example"):
        raise ValueError(f"train.sft_steps={cfg.train.sft_steps} but task {cfg.task.name!r} has no sft_example()")
    trainer.set_lr(cfg.train.sft_lr)
    for step in range(cfg.train.sft_steps):
        if stop():
            return False
        metrics = trainer.sft_step(sft_samples(task, step, cfg.train.sft_batch))
        log(step, metrics)
    trainer.set_lr(cfg.train.optim.lr)
    return True


def sft_samples(task: Task, step: int, batch: int) -> list[Sample]:
    """Warm-start step `step`'s batch: the task's reference answers, from an index range of their own."""
    samples = []
    for j in range(batch):
        prompt_ids, target_ids = task.sft_example(1_000_000 + step * batch + j)
        samples.append(Sample(prompt_ids, target_ids, [0.0] * len(target_ids), 0.0, None))
    return samples


def eval_plan(cfg: MoerlConfig, task: Task):
    """`[eval]` resolved against its eval set (opened here, before Ray: a bad eval set fails the run now);
    None when eval is off."""
    from moerl.loop.evaluation import EvalPlan, eval_prompt_count, open_eval_set

    e = cfg.eval
    if not e.enabled:
        return None
    eval_set = open_eval_set(task, cfg.task.name, dict(cfg.task.options), e.path, cfg.run.seed)
    return EvalPlan(every=e.every, before_train=e.before_train, prompts=eval_prompt_count(eval_set.size, e.samples),
                    k=e.k, temperature=e.temperature, path=e.path, workers=e.workers,
                    chunk=max(1, cfg.rollout.max_batch_size // e.k), max_new_tokens=e.max_new_tokens,
                    timeout_s=e.timeout_s)


def _eval_line(step: int, m: dict) -> str:
    scores = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items()
                       if k == "eval/reward" or k.startswith("eval/pass@"))
    return (f"eval at step {step}: {scores or 'nothing scored'}, length {m.get('eval/length', 0):.1f} "
            f"({m['eval/prompts']:.0f} prompts{', partial' if m['eval/partial'] else ''}, {m['eval/seconds']:.1f} s)")


def _fingerprint(cfg: MoerlConfig, arch: MoEModelConfig) -> dict:
    """What a checkpoint must agree on with the config that resumes it (checked before anything runs)."""
    return {"architecture": {k: v for k, v in arch.to_hf_dict().items() if k not in ("bos_token_id", "pad_token_id")},
            "ep_size": cfg.ep.size, "num_ranks": cfg.train.num_ranks, "task": cfg.task.name}


@dataclass
class Prepared:
    """What the preflight checks built, for the run to use: the task, the architecture, the step to resume."""

    task: Task
    arch: MoEModelConfig
    resume_step: int | None
    eval_plan: object | None = None  # moerl.loop.evaluation.EvalPlan, when [eval] is on
    lock: RunLock | None = None  # the run directory's, held until the run ends (moerl/run_dir.py)
    complete: bool = False  # --resume of a checkpoint at train.steps: nothing to train
    notes: list[str] = dataclasses.field(default_factory=list)  # lines the run says as it starts
    checkpoint_lock: RunLock | None = None  # a local checkpoint.dir's: no other run saves there meanwhile

    def release(self) -> None:
        for lock in (self.checkpoint_lock, self.lock):
            if lock is not None:
                lock.release()


def prepare(cfg: MoerlConfig, *, resume: bool = False, resume_step: int | None = None,
            resume_overrides: Sequence[str] = ()) -> Prepared:
    """Every check of moerl/preflight.py, in its order, before Ray starts: a run that cannot work fails here,
    in seconds and in one line, rather than in an actor or at its first checkpoint."""
    from moerl.checkpoint import CheckpointStore

    resume = resume or resume_step is not None
    run_dir = Path(cfg.run.dir)
    new_dirs = [d for d in (run_dir, Path(cfg.checkpoint_dir())) if "://" not in str(d) and not d.exists()]
    lock = RunLock(run_dir)
    checkpoint_lock = _checkpoint_lock(cfg.checkpoint_dir(), run_dir)
    notes = []
    try:
        preflight.check_device(cfg)
        preflight.check_run_dir(run_dir)
        lock.acquire()  # before the checks that look for a run there: two runs starting at once cannot both pass
        if lock.took_over:
            notes.append(f"run.dir {run_dir}: took over {lock.took_over}")
        store = CheckpointStore(cfg.checkpoint_dir(), cfg.checkpoint.storage_timeout_s)
        store.probe()  # a run that cannot save finds out now, not at its first save (within the deadline)
        if checkpoint_lock is not None:  # before the checks that look for steps there, as the run.dir's
            checkpoint_lock.acquire()
        if not resume:
            preflight.check_no_run(run_dir, store)
        checked_arch = preflight.check_model(cfg.model.path) if cfg.model.path else None
        task = preflight.check_task(cfg)
        try:
            arch = checked_arch or model_architecture(cfg, task)
        except ValueError as e:
            raise PreflightError(str(e)) from e
        preflight.check_tokenizer(task, arch)
        preflight.check_expert_split(cfg, arch)
        preflight.check_capacity(cfg, arch)
        preflight.check_deterministic(cfg, resolve_device(cfg))
        preflight.check_eval_task(cfg, task)
        try:
            plan = eval_plan(cfg, task)  # opens the eval set: a bad one fails here
        except Exception as e:  # noqa: BLE001 - TaskError and the data readers' errors
            raise PreflightError(f"eval.path: {one_line(e)}") from e
        step = (preflight.check_resume(store, _fingerprint(cfg, arch), every=cfg.checkpoint.every, step=resume_step,
                                       run_dir=run_dir) if resume else None)
        complete = False
        if step is not None:  # what it restores, what it rolls back, what changed: said before anything starts
            manifest = store.read_manifest(step)
            changes = check_config(manifest, cfg, step, resume_overrides)
            complete = is_complete(step, cfg)
            newer = [s for s in store.step_dirs() if s > step]  # the uncommitted ones: saves cut short
            unsaved = sorted(set(newer) - set(store.committed_steps())) if newer else []
            notes += resume_statement(step, manifest, preflight.last_logged_step(run_dir), unsaved, changes,
                                      store.root)
        preflight.check_ray_address(cfg.ray.address or os.environ.get("RAY_ADDRESS", ""), cfg.ray.connect_timeout_s,
                                    lambda text: print(text, file=sys.stderr, flush=True))
        if cfg.run.wandb:
            from moerl.runlog.wandb_log import import_wandb

            import_wandb()  # WandbMissing: one line naming `pip install wandb`
    except BaseException:
        if checkpoint_lock is not None:
            checkpoint_lock.release()
        lock.release()
        for d in reversed(new_dirs):  # a run that did not start leaves no directory behind (only empty ones go)
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return Prepared(task, arch, step, plan, lock, complete, notes, checkpoint_lock)


def _checkpoint_lock(checkpoint_dir: str, run_dir: Path) -> RunLock | None:
    """The lock of a local checkpoint.dir (its own `moerl.lock`; none on S3, which has no flock, nor when it is the
    run directory itself, locked already)."""
    if "://" in checkpoint_dir:
        return None
    path = Path(checkpoint_dir)
    if path.resolve() == run_dir.resolve():
        return None
    return RunLock(path, "checkpoint.dir")


class StopSignals:
    """SIGTERM and a first Ctrl-C (SIGINT) ask the loop to stop: it saves a checkpoint and returns, and
    `moerl train` exits 128 + the signal (143, 130). A second Ctrl-C aborts at once (KeyboardInterrupt, no save).
    Installed only from the main thread (signal handlers can be set nowhere else)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None  # the first signal received
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        """Set the handlers; again after `ray.init`, whose core worker puts in its own (C++) SIGTERM handler,
        which would abort the driver."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous = signal.signal(sig, self._handle)
                self._previous.setdefault(sig, previous)  # the handler from before the first install
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.event.is_set():
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # the second Ctrl-C: abort now
            return
        self.signum = signum
        self.event.set()
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        # os.write, not print: a handler that prints can interrupt a print of the main thread (reentrant call)
        os.write(2, f"\n{what}: stopping; saving a checkpoint first (Ctrl-C again aborts without saving)\n".encode())


def _joins_cluster(cfg: MoerlConfig) -> bool:
    return bool(cfg.ray.address or os.environ.get("RAY_ADDRESS"))


def _local_ray_auth(cfg: MoerlConfig) -> None:
    """A private local Ray listens on 127.0.0.1 only and requires a token (unless the environment says otherwise:
    moerl/local_ray.py). Ray reads both when it is imported, so this runs first; when the caller has imported Ray
    already, its own settings stand."""
    local_ray.loopback_env(not _joins_cluster(cfg))


def _init_ray(cfg: MoerlConfig, token: local_ray.RunToken, stop: Callable[[], bool] = lambda: False,
              keep: threading.Event | None = None) -> bool:
    """Join `ray.address` (or RAY_ADDRESS), else start a private local Ray on 127.0.0.1 with the run's own token
    (`token`, closed by the caller after ray.shutdown); True if we started it. Within ray.start_timeout_s (else
    StartupTimeout), from a thread that holds SIGTERM, so that Ray's processes leave a process group's SIGTERM to
    this driver, and that lives until `keep` is set (after ray.shutdown): see moerl/startup.py."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    if not address:
        token.open()  # the run's private directory: its token and Ray's temp dir (no 0777 session directories)
    init = {"address": address} if address else {
        "num_cpus": cfg.ray.num_cpus or None, "include_dashboard": False, "_node_ip_address": "127.0.0.1",
        "_temp_dir": token.ray_temp_dir}
    env_vars = {"OMP_NUM_THREADS": "1"}
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "") if not address else ""
    if loopback:  # gloo's connections of a local run stay on loopback (by default it listens on the host's IP)
        env_vars["GLOO_SOCKET_IFNAME"] = loopback
    what = f"joining the Ray cluster at {address}" if address else "starting a local Ray"
    if address:  # a cluster's workers take the run's environment from Ray's runtime env
        init["runtime_env"] = {"env_vars": env_vars}
    with local_ray.quiet_thread_warning(), local_ray.inherited_env({} if address else env_vars):
        run_within(lambda: ray.init(**init, log_to_driver=cfg.run.log_level == "debug"),
                   deadline_s=cfg.ray.start_timeout_s, what=what, key="ray.start_timeout_s", stop=stop,
                   hold_sigterm=True, keep_until=keep)
    return True


def _loop_config(cfg: MoerlConfig):
    from moerl.loop.controller import LoopConfig

    return LoopConfig(steps=cfg.train.steps, batch_groups=cfg.train.batch_groups, group_size=cfg.rollout.group_size,
                      max_staleness=cfg.train.max_staleness, mode=cfg.train.mode, stale_policy=cfg.train.stale_policy,
                      max_inflight_per_worker=cfg.rollout.inflight_groups(), deterministic=cfg.run.deterministic,
                      checkpoint_every=cfg.checkpoint.every, time_limit_s=cfg.train.time_limit_s,
                      forced_staleness=cfg.train.forced_staleness,
                      step_timeout_s=cfg.train.step_timeout_s, max_failed_fraction=cfg.train.max_failed_fraction,
                      failure_window=cfg.train.failure_window)


def train(cfg: MoerlConfig, *, resume: bool = False, resume_step: int | None = None,
          prepared: Prepared | None = None) -> dict:
    """Run the whole job; returns the final loop state's counters and the last metrics.

    resume: continue from the newest committed checkpoint under `checkpoint.dir` (trainer and controller
    state, in-flight work included); resume_step: from that committed step instead. `prepared`: what
    `prepare` returned (it runs here when not given). SIGTERM or Ctrl-C to this process saves a checkpoint
    and stops cleanly: the result's "stopped" holds the signal's number (else None)."""
    _local_ray_auth(cfg)
    owns_lock = prepared is None  # a caller that prepared releases the run directory's lock itself
    prepared = prepared or prepare(cfg, resume=resume, resume_step=resume_step)
    import ray

    from moerl.actors.checkpointer import Checkpointer
    from moerl.actors.pools import RayRolloutPool, RayTrainerGroup, TrainerLost
    from moerl.actors.respawn import RespawnPolicy
    from moerl.actors.weight_sync.sync import RayWeightSync
    from moerl.checkpoint import CheckpointError, serving_files
    from moerl.loop.controller import Controller
    from moerl.loop.dynamic_sampling import DynamicSampling
    from moerl.loop.evaluation import Evaluator
    from moerl.loop.samples import SampleBuilder
    from moerl.loop.work_queue import WorkQueue
    from moerl.runlog.health import HealthWatch
    from moerl.runlog.mismatch import BehaviourKLWatch
    from moerl.runlog.reporter import RunReporter

    run_dir = Path(cfg.run.dir)
    task, arch = prepared.task, prepared.arch
    plan = prepared.eval_plan
    worker_spec, trainer_spec = _specs(cfg, arch, task)
    checkpointer = Checkpointer(cfg.checkpoint_dir(), cfg.checkpoint.keep, arch, _fingerprint(cfg, arch),
                                dtype=cfg.model.dtype, timeout_s=cfg.checkpoint.timeout_s,
                                max_failures=cfg.checkpoint.max_failures,
                                serving_files=serving_files(cfg.model.path, getattr(task.tokenizer, "directory", None)),
                                storage_timeout_s=cfg.checkpoint.storage_timeout_s,
                                hf_export=str(run_dir / "hf") if cfg.checkpoint.hf_export else None,
                                config=saved_config(cfg))
    resuming = prepared.resume_step is not None
    if cfg.run.deterministic:
        cfg.train.mode = "sync"  # deterministic = sync, fixed seeds, batches in task order (docs/checkpoints.md)
    signals = StopSignals().install()  # before Ray starts: a Ctrl-C while it starts is a graceful stop too
    stop = signals.event
    ours = not ray.is_initialized()  # Ray is started (or joined) here, so shut down here, however the run ends
    token = local_ray.RunToken()  # a local Ray's own token file (moerl/local_ray.py), removed after ray.shutdown
    ray_thread = threading.Event()  # set after ray.shutdown: the thread that started Ray may end (moerl/startup.py)
    report = None
    t_start = time.monotonic()
    last: dict = {}

    def result(step: int, **extra) -> dict:
        return {"step": step, "steps": cfg.train.steps, "stopped": signals.signum if stop.is_set() else None,
                "checkpoint_step": checkpointer.latest(), "metrics": dict(last), **extra}

    try:
        # the run log, progress lines, plots and W&B; the checkpointer and the rollout pool report through `event`
        wandb = ({"project": cfg.run.wandb_project, "name": cfg.run.wandb_name or cfg.run.name,
                  "mode": cfg.run.wandb_mode} if cfg.run.wandb else None)
        report = RunReporter(run_dir, cfg.train.steps, resume=resuming, wandb=wandb, tensorboard=cfg.run.tensorboard,
                             plot_every_s=60.0 if cfg.run.plots else 0.0,
                             config=redact_config({k: v for k, v in dataclasses.asdict(cfg).items() if k != "launch"}))
        checkpointer.on_event = report.event
        report.stage(f"run {cfg.run.name}: {cfg.train.steps} RL steps"
                     + (f" after a {cfg.train.sft_steps}-step warm start" if cfg.train.sft_steps and not resuming
                        else "") + f"; outputs in {run_dir}")
        for note in prepared.notes:
            report.stage(note)
        if ours:
            address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
            report.stage(f"joining Ray at {address}" if address else
                         f"starting a local Ray ({cfg.ray.num_cpus or 'all'} CPUs)")
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # until ours is back: Ray's aborts
        try:
            _init_ray(cfg, token, stop.is_set, ray_thread)
        except StartupStopped:
            return result(0, nothing_trained=True)
        finally:
            signals.install()  # again: ray.init put in its own (C++) SIGTERM handler
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        report.stage(f"starting {cfg.train.num_ranks} trainer rank{'s' * (cfg.train.num_ranks > 1)}")
        try:
            trainer = RayTrainerGroup(trainer_spec, cfg.train.num_ranks, cfg.train.cpus_per_rank,
                                      cfg.train.gpus_per_rank, cfg.train.start_timeout_s, stop.is_set)
        except StartupStopped:  # stopped while the ranks were placed and built: nothing trained, nothing to save
            return result(0, nothing_trained=True)
        if resuming:
            report.stage(f"loading checkpoint step {prepared.resume_step} under {cfg.checkpoint_dir()}")
        restored = (checkpointer.restore(trainer, step=prepared.resume_step, verified=True) if resuming else None)
        if restored is None and cfg.train.sft_steps and not stop.is_set():
            report.stage(f"warm start: {cfg.train.sft_steps} supervised steps")
        if restored is None and not warm_start(trainer, task, cfg,
                                               lambda i, m: report.warm_start(i, cfg.train.sft_steps, m), stop.is_set):
            return result(0, nothing_trained=True)  # stopped in the warm start: no RL step to save
        if stop.is_set():  # stopped while Ray and the trainer started: nothing new to save
            return result(restored[0], nothing_trained=False) if restored else result(0, nothing_trained=True)
        report.stage(f"starting {cfg.rollout.num_workers} rollout worker{'s' * (cfg.rollout.num_workers > 1)}")
        queue = WorkQueue(lease_timeout=cfg.rollout.lease_timeout_s, max_attempts=cfg.rollout.max_attempts)
        workers = RayRolloutPool(worker_spec, cfg.rollout.num_workers, cfg.rollout.cpus_per_worker,
                                 cfg.rollout.gpus_per_worker, queue, cfg.rollout.heartbeat_s,
                                 cfg.rollout.heartbeat_timeout_s, cfg.rollout.inflight_groups(),
                                 cfg.rollout.start_timeout_s, on_event=report.event,
                                 min_workers=cfg.rollout.min_workers,
                                 respawn=RespawnPolicy(cfg.rollout.worker_losses_limit(), cfg.rollout.respawn_backoff_s,
                                                       cfg.rollout.respawn_backoff_max_s))
        weights = RayWeightSync(trainer, workers, cfg.weights.transport, cfg.weights.bucket_mb << 20,
                                cfg.weights.timeout_s)
        builder = SampleBuilder(task, cfg.train.loss.normalize_adv_std, len(arch.moe_layer_indices), arch.num_experts)
        kl_watch = BehaviourKLWatch(cfg.train.behaviour_kl_bound, lambda text: report.event("warning", text))
        health = HealthWatch(cfg.train.health, lambda text: report.event("warning", text))

        def on_step(step: int, metrics: dict, rows: list[dict]) -> None:
            metrics["workers/waiting"] = workers.waiting()  # for capacity: a count only the Ray side knows
            row = report.step(step, metrics, builder.add_text(rows))  # text decoded here: off the trainer's path
            kl_watch.observe(step, row)
            health.observe(step, row)
            last.clear()
            last.update({k: v for k, v in row.items() if isinstance(v, float)})

        def on_eval(step: int, metrics: dict) -> None:  # logged at the step whose weights it evaluated
            report.log_metrics(step, metrics)
            report.event("eval", _eval_line(step, metrics))

        controller = Controller(_loop_config(cfg), task, queue, workers, trainer, weights, builder, on_step,
                                checkpoints=checkpointer, stop_requested=stop.is_set,
                                evaluator=(Evaluator(plan, workers, on_eval, lambda text: report.event("eval", text))
                                           if plan else None),
                                dynamic=(DynamicSampling(cfg.train.dynamic_sampling_limit(),
                                                         lambda text: report.event("dynamic_sampling", text))
                                         if cfg.train.dynamic_sampling else None),
                                warn=lambda text: report.event("warning", text))
        if restored is not None:
            try:
                controller.load_state_dict(restored[1])
            except (KeyError, TypeError, ValueError, AttributeError) as e:  # plain data, but not a controller's state
                raise CheckpointError(f"checkpoint step {restored[0]}: controller.pt does not hold a controller state "
                                      f"this moerl can load ({type(e).__name__}: {e})") from None
            # steps after the checkpoint are trained (and logged) again
            dropped = report.log.truncate_after(restored[0])
            report.stage(f"resumed from checkpoint step {restored[0]} under {cfg.checkpoint_dir()}"
                         + (f"; dropped {dropped} log rows of later steps" if dropped else ""))
        report.begin_rl()
        try:
            state = controller.run()
        except TrainerLost as e:
            latest = checkpointer.latest()
            raise TrainerLost(f"{e}; " + (f"the newest committed checkpoint is step {latest}: resume with --resume"
                                          if latest is not None else "no checkpoint was committed (checkpoint.every "
                                          "is 0 or was not reached), so a new run starts from step 0")) from None
        last["elapsed_s"] = time.monotonic() - t_start
        return result(state.step, counters=dict(state.counters), queue=queue.stats(),
                      failed_tasks=[t.task_id for t in queue.failed], weights=dict(weights.stats))
    finally:  # each step runs even when one before it fails (a failing log.close() used to skip ray.shutdown())
        try:
            # No Ray call and no collection of a Ray object while Ray shuts down: either ends this process with
            # _exit(1) (moerl/ray_gc.py). The freeze comes first: the final plots' thread allocates meanwhile.
            with gc_frozen():
                if report is not None:
                    report.finish()  # never raises; the final plots are written while Ray shuts down
                checkpointer.close()  # its save job's Ray calls end here
                if ours and ray.is_initialized():
                    local_ray.shutdown_held()  # ours holds SIGTERM: SIGKILL at once (ray.shutdown() waits 5 s)
        finally:
            ray_thread.set()
            token.close()
            if report is not None:
                report.close()  # waits for the plots
            signals.restore()
            if owns_lock:
                prepared.release()
