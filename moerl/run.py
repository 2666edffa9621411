"""`moerl train CONFIG [--dotted.key=value ...]`: the one composition root. It builds every part from the
config (task, model architecture, the Ray trainer group and rollout pool, weight sync, checkpoints, the run
log) and hands them to the loop's Controller.

    moerl train configs/demo.toml --train.steps=20 --rollout.num_workers=3

With no `ray.address` (and no RAY_ADDRESS) a local Ray instance is started on 127.0.0.1 and stopped at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch

from moerl.config import MoerlConfig
from moerl.model import MoEModelConfig, read_config, read_stop_token_ids, tiny_config
from moerl.rollout import EngineConfig, SamplingParams
from moerl.tasks.base import Task, load_task, stop_token_ids
from moerl.train.trainer import Sample


def model_architecture(cfg: MoerlConfig, task: Task) -> MoEModelConfig:
    if cfg.model.path:
        return read_config(cfg.model.path)
    presets = {  # random-init architectures for runs without a checkpoint
        "tiny": dict(hidden_size=64, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=64, intermediate_size=128),
        "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=32, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
                      intermediate_size=512),
        # the 1.65B shape of the GPU measurements (issues 14-15): hidden 1024, 16 layers, 64 experts top-8
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
    from moerl.actors.rollout_worker import WorkerSpec
    from moerl.actors.trainer_actor import TrainerSpec

    device = resolve_device(cfg)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                              top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              stop_token_ids=run_stop_token_ids(cfg, task))
    engine = EngineConfig(max_batch_size=cfg.rollout.max_batch_size, max_seq_len=cfg.rollout.max_seq_len,
                          deterministic=cfg.run.deterministic, seed=cfg.run.seed)
    t = cfg.train
    worker = WorkerSpec(arch=arch.to_hf_dict(), model_path=cfg.model.path, dtype=cfg.model.dtype, device=device,
                        engine=engine, sampling=sampling, task_name=cfg.task.name, task_options=dict(cfg.task.options),
                        seed=cfg.run.seed, threads=cfg.rollout.threads, grace_s=cfg.rollout.grace_s,
                        imds_url=cfg.rollout.imds_url)
    trainer = TrainerSpec(arch=arch.to_hf_dict(), model_path=cfg.model.path, dtype=cfg.model.dtype, device=device,
                          optim=t.optim, loss=t.loss, ep_size=cfg.ep.size,
                          dispatcher=cfg.model.dispatcher, routing_replay=cfg.model.routing_replay,
                          aux_loss_coef=cfg.model.router_aux_loss_coef,
                          expert_bias_rate=cfg.model.expert_bias_update_rate,
                          capacity_factor=cfg.model.capacity_factor, seed=cfg.run.seed, threads=t.threads,
                          data_parallel=t.data_parallel, collective_timeout_s=t.collective_timeout_s,
                          master_dtype=t.master_dtype, micro_batch_tokens=t.micro_batch_tokens,
                          activation_checkpointing=t.activation_checkpointing,
                          temperature=cfg.rollout.temperature)
    return worker, trainer


def warm_start(trainer, task: Task, cfg: MoerlConfig, log) -> None:
    """Supervised steps on the task's reference answers, so RL starts from a policy that knows the format."""
    if cfg.train.sft_steps == 0:
        return
    if not hasattr(task, "sft_example"):
        raise ValueError(f"train.sft_steps={cfg.train.sft_steps} but task {cfg.task.name!r} has no sft_example()")
    trainer.set_lr(cfg.train.sft_lr)
    for step in range(cfg.train.sft_steps):
        samples = []
        for j in range(cfg.train.sft_batch):
            prompt_ids, target_ids = task.sft_example(1_000_000 + step * cfg.train.sft_batch + j)
            samples.append(Sample(prompt_ids, target_ids, [0.0] * len(target_ids), 0.0, None))
        metrics = trainer.sft_step(samples)
        log(step, metrics)
    trainer.set_lr(cfg.train.optim.lr)


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


def _local_ray_auth(cfg: MoerlConfig) -> None:
    """A private local Ray gets token authentication unless the environment says otherwise: its servers listen
    on every interface, and with the token nothing else on the network can use them. Ray reads the mode when it
    is imported, so this runs first; when the caller has imported Ray already, its own setting stands."""
    if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")) and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def _init_ray(cfg: MoerlConfig) -> bool:
    """Join `ray.address` (or RAY_ADDRESS), else start a private local Ray on 127.0.0.1; True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    init = {"address": address} if address else {
        "num_cpus": cfg.ray.num_cpus or None, "include_dashboard": False, "_node_ip_address": "127.0.0.1"}
    env_vars = {"OMP_NUM_THREADS": "1"}
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "") if not address else ""
    if loopback:  # gloo's connections of a local run stay on loopback (by default it listens on the host's IP)
        env_vars["GLOO_SOCKET_IFNAME"] = loopback
    ray.init(**init, log_to_driver=cfg.run.log_level == "debug", runtime_env={"env_vars": env_vars})
    return True


def _loop_config(cfg: MoerlConfig):
    from moerl.loop.controller import LoopConfig

    return LoopConfig(steps=cfg.train.steps, batch_groups=cfg.train.batch_groups, group_size=cfg.rollout.group_size,
                      max_staleness=cfg.train.max_staleness, mode=cfg.train.mode, stale_policy=cfg.train.stale_policy,
                      max_inflight_per_worker=cfg.rollout.inflight_groups(), deterministic=cfg.run.deterministic,
                      checkpoint_every=cfg.checkpoint.every)


def train(cfg: MoerlConfig, *, resume: bool = False) -> dict:
    """Run the whole job; returns the final loop state's counters and the last metrics.

    resume: continue from the newest committed checkpoint under `checkpoint.dir` (trainer and controller
    state, in-flight work included); SIGTERM to this process saves a checkpoint and stops cleanly."""
    _local_ray_auth(cfg)
    import ray

    from moerl.actors.checkpointer import Checkpointer
    from moerl.actors.pools import RayRolloutPool, RayTrainerGroup, TrainerLost
    from moerl.actors.weight_sync.sync import RayWeightSync
    from moerl.checkpoint import serving_files
    from moerl.loop.controller import Controller
    from moerl.loop.dynamic_sampling import DynamicSampling
    from moerl.loop.evaluation import Evaluator
    from moerl.loop.samples import SampleBuilder
    from moerl.loop.work_queue import WorkQueue
    from moerl.runlog.plots import write_plots
    from moerl.runlog.progress import Progress
    from moerl.runlog.run_log import RunLog

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    task = load_task(cfg.task.name, dict(cfg.task.options), seed=cfg.run.seed)
    arch = model_architecture(cfg, task)
    plan = eval_plan(cfg, task)
    worker_spec, trainer_spec = _specs(cfg, arch, task)
    checkpointer = Checkpointer(cfg.checkpoint_dir(), cfg.checkpoint.keep, arch, _fingerprint(cfg, arch),
                                dtype=cfg.model.dtype, timeout_s=cfg.checkpoint.timeout_s,
                                max_failures=cfg.checkpoint.max_failures,
                                serving_files=serving_files(cfg.model.path, getattr(task.tokenizer, "directory", None)))
    checkpointer.store.probe()  # before Ray starts: a run that cannot save finds out now, not at its first save
    if resume and checkpointer.latest() is None:
        raise FileNotFoundError(f"--resume: no committed checkpoint under {cfg.checkpoint_dir()!r}")
    started_ray = _init_ray(cfg)
    if cfg.run.deterministic:
        cfg.train.mode = "sync"  # deterministic = sync, fixed seeds, batches in task order (docs/checkpoints.md)
    stop = threading.Event()
    previous_handler = None
    if threading.current_thread() is threading.main_thread():
        previous_handler = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log = RunLog(run_dir, resume=resume)
    progress = Progress(cfg.train.steps)
    t_start = time.monotonic()
    last: dict = {}
    try:
        trainer = RayTrainerGroup(trainer_spec, cfg.train.num_ranks, cfg.train.cpus_per_rank, cfg.train.gpus_per_rank)
        restored = checkpointer.restore(trainer) if resume else None
        if restored is None:
            warm_start(trainer, task, cfg, lambda s, m: log.log_step(-cfg.train.sft_steps + s, _scalars(m, "sft/")))
        queue = WorkQueue(lease_timeout=cfg.rollout.lease_timeout_s, max_attempts=cfg.rollout.max_attempts)
        workers = RayRolloutPool(worker_spec, cfg.rollout.num_workers, cfg.rollout.cpus_per_worker,
                                 cfg.rollout.gpus_per_worker, queue, cfg.rollout.heartbeat_s,
                                 cfg.rollout.heartbeat_timeout_s, cfg.rollout.inflight_groups(),
                                 cfg.rollout.start_timeout_s)
        weights = RayWeightSync(trainer, workers, cfg.weights.transport, cfg.weights.bucket_mb << 20,
                                cfg.weights.timeout_s)
        builder = SampleBuilder(task, cfg.train.loss.normalize_adv_std, len(arch.moe_layer_indices), arch.num_experts)
        samples_seen = [0]

        def on_step(step: int, metrics: dict, rows: list[dict]) -> None:
            elapsed = time.monotonic() - t_start
            samples_seen[0] += metrics.get("samples", 0)
            metrics["throughput/samples_per_s"] = samples_seen[0] / elapsed
            log.log_expert_load(step, "rollout", metrics.pop("expert_counts_rollout"))
            log.log_expert_load(step, "trainer", metrics.pop("expert_counts"))
            scalars = _scalars(metrics)
            log.log_step(step, scalars)
            log.log_trajectories(rows)
            progress.update(step, scalars)
            last.clear()
            last.update(scalars)

        def on_eval(step: int, metrics: dict) -> None:  # logged at the step whose weights it evaluated
            log.log_step(step, metrics)
            progress.message(_eval_line(step, metrics))

        controller = Controller(_loop_config(cfg), task, queue, workers, trainer, weights, builder, on_step,
                                checkpoints=checkpointer, stop_requested=stop.is_set,
                                evaluator=Evaluator(plan, workers, on_eval, progress.message) if plan else None,
                                dynamic=(DynamicSampling(cfg.train.dynamic_sampling_limit(), progress.message)
                                         if cfg.train.dynamic_sampling else None))
        if restored is not None:
            controller.load_state_dict(restored[1])
            dropped = log.truncate_after(restored[0])  # steps after the checkpoint are trained (and logged) again
            progress.message(f"resumed from checkpoint step {restored[0]} under {cfg.checkpoint_dir()}"
                             + (f"; dropped {dropped} log rows of later steps" if dropped else ""))
        try:
            state = controller.run()
        except TrainerLost as e:
            latest = checkpointer.latest()
            raise TrainerLost(f"{e}; " + (f"the newest committed checkpoint is step {latest}: resume with --resume"
                                          if latest is not None else "no checkpoint was committed (checkpoint.every "
                                          "is 0 or was not reached), so a new run starts from step 0")) from None
        last["elapsed_s"] = time.monotonic() - t_start
        return {"counters": dict(state.counters), "step": state.step, "stopped": stop.is_set(),
                "metrics": dict(last), "queue": queue.stats(), "failed_tasks": [t.task_id for t in queue.failed],
                "weights": dict(weights.stats)}
    finally:  # each step runs even when one before it fails (a failing log.close() used to skip ray.shutdown())
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        for what, close in (("progress", progress.close), ("run log", log.close), ("plots", lambda: write_plots(run_dir))):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - the run's outcome (or its exception) is what matters here
                print(f"warning: {what} not closed cleanly: {type(e).__name__}: {e}")
        if started_ray:
            ray.shutdown()


def _scalars(metrics: dict, prefix: str = "") -> dict:
    return {prefix + k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def main(argv: list[str]) -> int:
    from moerl.config import ConfigError, load_config

    if not argv or argv[0].startswith("-"):
        print("usage: moerl train CONFIG.toml [--resume] [--section.key=value ...]")
        return 2
    resume = "--resume" in argv
    argv = [a for a in argv if a != "--resume"]
    try:
        cfg = load_config(argv[0], argv[1:])
    except ConfigError as e:
        print(f"error: {e}")
        return 2
    from moerl.actors.pools import TrainerLost
    from moerl.model.config import CheckpointError

    try:
        result = train(cfg, resume=resume)
    except (TrainerLost, CheckpointError) as e:
        print(f"error: {e}" + (f" (moerl train {' '.join(argv)} --resume)" if "--resume" in str(e) else ""))
        return 1
    m = result["metrics"]
    print(f"done: {cfg.train.steps} steps in {m.get('elapsed_s', 0):.0f}s, final reward/mean "
          f"{m.get('reward/mean', float('nan')):.3f}; outputs in {cfg.run.dir}")
    print(f"counters: {result['counters']}")
    return 0

