"""Typed, nested dataclass configs: TOML files under `configs/` plus dotted command-line overrides.

    cfg = load_config("configs/demo.toml", ["--train.steps=20", "--rollout.num_workers=3"])

The schema (`MoerlConfig`) is plain dataclasses with defaults; the generic loader is moerl/config_loader.py
(precedence: field defaults < TOML file < overrides; errors name the dotted key). Every field's description is
its attribute docstring, the string right under it: the one source that `moerl config --reference` (docs/config.md,
moerl/config_docs.py) and `moerl train --help` read, and that editors show on hover. To add a field: give it a
default and a docstring, put its checks in the section's `validate()`, and regenerate docs/config.md (a test fails
until it matches). To move a key, list its old and new dotted names in `MOVED_KEYS`: the old one then fails with
an error naming the new. `ConfigError` and `require` live in the torch-free `moerl.checks` and are re-exported.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from moerl import config_loader
from moerl.checks import ConfigError, require
from moerl.config_loader import COMMAND_LINE, config_to_dict, dump_toml
from moerl.redact import looks_secret, secret_in_value
from moerl.train.config import LossConfig, OptimConfig

__all__ = ["COMMAND_LINE", "MOVED_KEYS", "ConfigError", "MoerlConfig", "config_from_dict", "config_to_dict",
           "dump_toml", "load_config", "require"]
T = TypeVar("T")

# Keys that have moved: old dotted key -> new dotted key. A file or override that still uses the old key gets a
# ConfigError naming the new one (before the generic unknown-key error).
MOVED_KEYS: dict[str, str] = {
    "train.lr": "train.optim.lr",
    "train.grad_clip": "train.optim.grad_clip",
    "train.clip_eps_low": "train.loss.clip_eps_low",
    "train.clip_eps_high": "train.loss.clip_eps_high",
    "train.is_correction": "train.loss.is_correction",
    "train.is_cap": "train.loss.is_cap",
    "train.kl_coef": "train.loss.kl_coef",
    "train.normalize_adv_std": "train.loss.normalize_adv_std",
}


# ----------------------------------------------------------------------------------------- schema
@dataclass
class RunConfig:
    name: str = "demo"
    """run name, shown in logs and metrics"""
    dir: str = "runs/demo"
    """where everything of the run is written (logs, metrics, checkpoints)"""
    seed: int = 0
    """global random seed"""
    deterministic: bool = False
    """CPU only (preflight refuses it on a GPU): torch's deterministic algorithms in every trainer and rollout
    process, sync mode, batches in task order, log-probs and routing from one full forward (bitwise = the
    trainer's)
    """
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when available, else cpu"""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """logging verbosity"""
    plots: bool = True
    """rewrite the run's PNG curves (reward, throughput, step time, expert load) every minute and at the end"""
    tensorboard: bool = True
    """write TensorBoard event files under <run.dir>/tensorboard (metrics.jsonl is written either way)"""
    wandb: bool = False
    """also log to Weights & Biases (pip install wandb)"""
    wandb_project: str = "moerl"
    """the W&B project"""
    wandb_name: str = ""
    """the W&B run name; empty = run.name"""
    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    """offline: no network (`wandb sync` later); auto: env"""


@dataclass
class ModelConfig:
    path: str = ""
    """Hugging Face checkpoint directory; empty = random-init model from `preset`"""
    preset: str = "tiny"
    """named architecture used when `path` is empty"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """the trainer's forward/backward dtype and the rollout engine's weights (master weights: train.master_dtype)"""
    dispatcher: Literal["auto", "local", "all_to_all", "symm_mem"] = "auto"
    """MoE token dispatch backend"""
    capacity_factor: float = 0.0
    """Expert capacity as a multiple of the even share; only 0 (dropless) is accepted: which tokens a capacity drops
    depends on the batch a forward sees, and the engine's decode batches are never the trainer's micro-batches,
    so the trainer would train a function the rollout did not sample from (drops are not replayed yet)
    """
    router_aux_loss_coef: float = 0.0
    """weight of the router load-balancing auxiliary loss"""
    expert_bias_update_rate: float = 0.0
    """aux-loss-free balancing: expert bias step; 0 = off"""
    routing_replay: bool = True
    """train on the expert routing recorded at rollout time"""

    def validate(self) -> None:
        require(self.capacity_factor == 0, "capacity_factor",
                "must be 0 (dropless): drops depend on the batch a forward sees, the rollout's batches are not the "
                "trainer's, and drops are not replayed, so the trainer would learn from another policy's samples")


@dataclass
class EPConfig:
    size: int = 1
    """expert-parallel group size: ranks that split the experts between them"""

    def validate(self) -> None:
        require(self.size >= 1, "size", "must be >= 1")


@dataclass
class RolloutConfig:
    num_workers: int = 2
    """rollout (generation) worker processes"""
    min_workers: int = 1
    """workers up before leases start; the rest join as Ray finds them room (spot nodes), with no deadline while
    they wait for capacity (docs/eks.md, "A fleet that grows")"""
    group_size: int = 8
    """completions sampled per prompt (one GRPO group)"""
    max_new_tokens: int = 32
    """generation length limit per completion"""
    temperature: float = 1.0
    """sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling probability mass; 1 = off"""
    top_k: int = 0
    """sample from the k most likely tokens only; 0 = off"""
    max_batch_size: int = 64
    """most sequences in one batched generation call"""
    max_seq_len: int = 512
    """prompt + completion tokens per sequence"""
    kv_block_size: int = 16
    """positions per KV-cache block (the unit of allocation and of prefix sharing)"""
    kv_cache_tokens: int = 0
    """KV-cache size; 0 = from gpu_memory_fraction (GPU), max_batch_size x max_seq_len (CPU)"""
    gpu_memory_fraction: float = 0.9
    """share of a GPU for the engine: weights + activation reserve + KV cache"""
    prefix_caching: bool = True
    """samples whose prompts share full KV blocks compute and store them once"""
    overlap_decode: Literal["auto", "on", "off"] = "auto"
    """launch decode step N+1 before reading step N's tokens (host bookkeeping off the device's critical path);
    outputs are identical either way; auto = on CUDA only; an engine group (ep_size > 1) always runs without it
    """
    ep_size: int = 1
    """ranks (GPUs) per rollout engine: experts split over them, dense layers on each (EngineGroup)"""
    max_inflight_groups: int = 0
    """prompt groups a worker works on at once; 0 = from the engine's batch"""
    cpus_per_worker: float = 1.0
    """Ray CPUs per worker (fractional is fine on a laptop)"""
    gpus_per_worker: float = 0.0
    """Ray GPUs per worker (fractional shares one GPU with a trainer rank: 0.45 on one H200); 0 = CPU"""
    threads: int = 1
    """torch threads per worker"""
    heartbeat_s: float = 2.0
    """ping period"""
    heartbeat_timeout_s: float = 60.0
    """a worker silent this long is lost; its leases go back"""
    start_timeout_s: float = 600.0
    """a worker placed but not built by then is a failed start (3 in a row end the run); fewer than min_workers
    placed by then end the run (waiting for capacity has no deadline once min_workers are up)"""
    lease_timeout_s: float = 600.0
    """a lease not renewed by a heartbeat this long returns to the queue"""
    max_attempts: int = 3
    """failed generations of a group (or deaths of the worker that ran it alone) before it fails"""
    max_worker_losses: int = 0
    """rollout workers lost in a row before any finished a group that end the run; 0 = max(8, 2 x num_workers)"""
    respawn_backoff_s: float = 1.0
    """a replacement after such losses waits this, doubled per loss in a row ..."""
    respawn_backoff_max_s: float = 60.0
    """... up to this"""
    grace_s: float = 90.0
    """preemption: hand back and exit within this"""
    imds_url: str = ""
    """EC2 spot notice URL to poll every 5 s ("" = off; SIGTERM always works)"""
    max_turns: int = 8
    """multi-turn tasks (docs/environments.md): model turns per episode; an episode still going is cut (trained
    with the rewards it collected, counted in episode/cut_turns)"""
    max_episode_tokens: int = 0
    """multi-turn tasks: model and observation tokens after the prompt per episode, cut past it; 0 = max_new_tokens"""
    tool_timeout_s: float = 30.0
    """multi-turn tasks: one environment step (a tool call) running past this fails its episode (never a zero)"""

    def validate(self) -> None:
        for name in ("num_workers", "max_new_tokens", "max_batch_size", "ep_size"):
            require(getattr(self, name) >= 1, name, "must be >= 1")
        # GRPO advantages are each reward minus its group's mean (moerl.train.loss.group_advantages)
        require(self.group_size >= 2, "group_size", "must be >= 2: an advantage is the reward minus its group's mean, "
                "so in a group of one every advantage is 0 and nothing is learned")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        require(self.max_inflight_groups >= 0, "max_inflight_groups", "must be >= 0 (0 = from max_batch_size)")
        require(self.start_timeout_s > 0, "start_timeout_s", "must be > 0")
        require(1 <= self.min_workers <= self.num_workers, "min_workers",
                f"must be in [1, rollout.num_workers={self.num_workers}]")
        require(0 < self.gpu_memory_fraction <= 1, "gpu_memory_fraction", "must be in (0, 1]")
        require(self.kv_block_size >= 1, "kv_block_size", "must be >= 1")
        require(self.kv_cache_tokens >= 0, "kv_cache_tokens", "must be >= 0 (0 = from memory)")
        require(self.max_attempts >= 1, "max_attempts", "must be >= 1")
        require(self.max_turns >= 1, "max_turns", "must be >= 1")
        require(0 <= self.max_episode_tokens < self.max_seq_len, "max_episode_tokens",
                f"must be in [0, rollout.max_seq_len={self.max_seq_len}) (0 = max_new_tokens)")
        require(self.tool_timeout_s > 0, "tool_timeout_s", "must be > 0")
        require(self.max_worker_losses >= 0, "max_worker_losses", "must be >= 0 (0 = max(8, 2 x num_workers))")
        require(self.respawn_backoff_s >= 0, "respawn_backoff_s", "must be >= 0")
        require(self.respawn_backoff_max_s >= self.respawn_backoff_s, "respawn_backoff_max_s",
                f"must be >= rollout.respawn_backoff_s ({self.respawn_backoff_s})")
        # max_seq_len bounds prompt + completion: a larger max_new_tokens would be cut short without a word.
        require(self.max_new_tokens < self.max_seq_len, "max_new_tokens",
                f"must be < rollout.max_seq_len={self.max_seq_len} (prompt + completion tokens): raise "
                "rollout.max_seq_len")

    def worker_losses_limit(self) -> int:
        return self.max_worker_losses or max(8, 2 * self.num_workers)

    def inflight_groups(self) -> int:
        """`max_inflight_groups`, or enough groups to fill the engine's batch twice: one batch decoding while
        the next groups' prompts wait to be admitted as sequences finish (continuous batching stays full)."""
        return self.max_inflight_groups or max(1, -(-2 * self.max_batch_size // self.group_size))


@dataclass
class HealthConfig:
    """Training-health warnings (moerl/runlog/health.py): each said on the console and in error.log once per
    episode (when it starts; again only after it has cleared for `window` steps), with its likely cause and knob."""

    entropy_floor: float = 0.05
    """policy/entropy (nats per token) under this for `window` steps; 0 = off"""
    ess_floor: float = 0.3
    """is/ess (effective sample size of the importance weights) under this; 0 = off"""
    all_equal_max: float = 0.95
    """reward/all_equal_frac (groups without signal) over this; 1 = off"""
    flat_reward_steps: int = 50
    """reward/mean at one value for this many steps in a row; 0 = off"""
    window: int = 5
    """steps in a row a condition must hold (and must be clear) before it is said"""

    def validate(self) -> None:
        require(self.entropy_floor >= 0, "entropy_floor", "must be >= 0 (0 = off)")
        require(0 <= self.ess_floor <= 1, "ess_floor", "must be in [0, 1] (0 = off)")
        require(0 < self.all_equal_max <= 1, "all_equal_max", "must be in (0, 1] (1 = off)")
        require(self.flat_reward_steps >= 0, "flat_reward_steps", "must be >= 0 (0 = off)")
        require(self.window >= 1, "window", "must be >= 1")


@dataclass
class TrainConfig:
    steps: int = 50
    """RL steps in the run (each is train.minibatches optimizer updates)"""
    batch_groups: int = 8
    """prompt groups consumed per RL step"""
    minibatches: int = 1
    """optimizer updates per RL step, each on a contiguous share of the batch; with more than one, the step first
    takes the policy's log-probs at its start (one no-grad forward), which train.loss.trust_region "proximal"
    clips against
    """
    max_staleness: int = 1
    """most policy versions a rollout may lag behind the learner"""
    mode: Literal["async", "sync"] = "async"
    """async = rollout overlaps training; sync = alternate"""
    forced_staleness: int = 0
    """experiments (async mode): every batch is generated by weights exactly this many versions behind the ones it
    is trained at (the first batches by the initial weights), whatever the timing: a pipeline of this depth held
    in lock-step, rollout and training overlapping; 0 = off (the staleness is whatever the run's pace gives)
    """
    num_ranks: int = 1
    """learner processes"""
    data_parallel: Literal["fsdp", "replicate"] = "fsdp"
    """across num_ranks: FSDP2-shard or replicate the weights"""
    stale_policy: Literal["drop", "regenerate"] = "drop"
    """what happens to groups over max_staleness"""
    sft_steps: int = 0
    """supervised warm-start steps before RL (on the task's reference answers)"""
    sft_batch: int = 32
    """examples per warm-start step"""
    sft_lr: float = 3e-3
    """warm-start learning rate"""
    cpus_per_rank: float = 1.0
    """Ray CPUs per trainer rank"""
    gpus_per_rank: float = 0.0
    """Ray GPUs per trainer rank (fractional to share one GPU with a rollout worker); 0 = CPU"""
    threads: int = 1
    """torch threads per trainer rank"""
    collective_timeout_s: float = 300.0
    """a rank silent this long in a step is named as the straggler"""
    start_timeout_s: float = 600.0
    """placing and building the trainer ranks (their model loaded, their group joined) may take this long; past it
    the run stops, naming the ranks not up and what each asks of the cluster
    """
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """parameters and AdamW state (compute: model.dtype)"""
    micro_batch_tokens: int = 0
    """positions per packed micro-batch (gradients accumulate); 0 = one per step"""
    activation_checkpointing: Literal[False, True, "selective"] = False
    """recompute in backward instead of keeping: true = each whole decoder layer, "selective" = all but its GEMM and
    attention outputs (moerl/model/checkpointing.py), false = nothing
    """
    reduce_grads_once: bool = False
    """FSDP (num_ranks > 1): reduce-scatter the gradients once per step, after the last micro-batch (FSDP2's no-
    sync), instead of after each. Fewer collectives; each rank holds the whole float32 gradients of its FSDP
    units between micro-batches (4 bytes per parameter: size it before turning it on)
    """
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no gradient), lease more"""
    dynamic_sampling_max_extra: int = 0
    """groups dropped per step at most (0 = 4 x batch_groups); past it all-equal groups are kept, with a warning"""
    behaviour_kl_bound: float = 0.2
    """is/behaviour_kl (per token) over this is said on the console and in error.log, once per episode (0 = off).
    bf16 numerics alone stay near 1e-4 in sync mode; the demo's async drift peaks near 0.1; a weight-sync bug
    read ~10 nats, and an async run on the H200 that collapsed passed 0.4 in its third step
    """
    time_limit_s: float = 0.0
    """RL ends after this many seconds (saved as on a graceful stop) if `steps` are not done; 0 = none"""
    step_timeout_s: float = 1800.0
    """no step for this long (from the previous step's end, or from the first rollout worker up) ends the run
    (exit 1), naming what it waits for; warned at each quarter; 0 = off
    """
    max_failed_fraction: float = 0.5
    """prompt groups failed for good, or samples whose reward failed, over this share of the last `failure_window`
    of them end the run (exit 1) naming the first; 1 = never (a run that trains no sample always fails)
    """
    failure_window: int = 100
    """groups (and samples) the failure share is taken over, once that many came back"""
    loss: LossConfig = field(default_factory=LossConfig)
    """the policy loss (moerl/train/loss.py)"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and its schedule"""
    health: HealthConfig = field(default_factory=HealthConfig)
    """collapse warnings (moerl/runlog/health.py)"""

    def validate(self) -> None:
        require(self.steps >= 1, "steps", "must be >= 1")
        require(self.minibatches >= 1, "minibatches", "must be >= 1")
        require(self.loss.trust_region != "proximal" or self.minibatches >= 2, "minibatches",
                "must be >= 2 with train.loss.trust_region = 'proximal': with one update per step the ratio to the "
                "step-start policy is always 1 and the clip bounds nothing (or use trust_region 'behaviour')")
        require(self.forced_staleness >= 0, "forced_staleness", "must be >= 0 (0 = off)")
        require(self.forced_staleness <= self.max_staleness, "forced_staleness",
                f"must be <= train.max_staleness ({self.max_staleness}): the staleness gate would drop every batch "
                "it forces")
        require(self.forced_staleness == 0 or self.mode == "async", "forced_staleness",
                "needs train.mode = 'async' (sync mode is staleness 0)")
        require(self.sft_steps >= 0, "sft_steps", "must be >= 0")
        require(self.sft_steps == 0 or self.sft_lr > 0, "sft_lr", "must be > 0 when sft_steps > 0")
        require(self.sft_steps == 0 or self.sft_batch >= 1, "sft_batch", "must be >= 1 when sft_steps > 0")
        for name in ("batch_groups", "num_ranks"):
            require(getattr(self, name) >= 1, name, "must be >= 1")
        require(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        require(self.micro_batch_tokens >= 0, "micro_batch_tokens", "must be >= 0 (0 = one micro-batch per step)")
        require(self.dynamic_sampling_max_extra >= 0, "dynamic_sampling_max_extra",
                "must be >= 0 (0 = 4 x batch_groups)")
        require(self.behaviour_kl_bound >= 0, "behaviour_kl_bound", "must be >= 0 (0 = off)")
        require(self.time_limit_s >= 0, "time_limit_s", "must be >= 0 (0 = none)")
        require(self.step_timeout_s >= 0, "step_timeout_s", "must be >= 0 (0 = off)")
        require(self.start_timeout_s > 0, "start_timeout_s", "must be > 0")
        require(0 < self.max_failed_fraction <= 1, "max_failed_fraction", "must be in (0, 1] (1 = never)")
        require(self.failure_window >= 1, "failure_window", "must be >= 1")

    def dynamic_sampling_limit(self) -> int:
        """Groups dynamic sampling may drop (and lease again) per step."""
        return self.dynamic_sampling_max_extra or 4 * self.batch_groups


@dataclass
class EvalConfig:
    """Evaluation during training (moerl/loop/evaluation.py): on rollout workers held at one step's weights."""

    every: int = 0
    """evaluate after every N optimizer steps; 0 = off (unless before_train)"""
    before_train: bool = False
    """also evaluate the weights the run starts from (logged at that step)"""
    path: str = ""
    """eval set in the task's data format (its `path` option); empty = the task's held-out split"""
    samples: int = 64
    """prompts per eval (the set's first ones); 0 = the whole eval set"""
    k: int = 1
    """samples per prompt: eval/pass@k"""
    temperature: float = 0.0
    """0 = greedy"""
    max_new_tokens: int = 0
    """0 = rollout.max_new_tokens"""
    workers: int = 1
    """rollout workers an eval holds (they take no training work meanwhile)"""
    timeout_s: float = 600.0
    """at the end of the run, wait this long for an eval in flight"""

    def validate(self) -> None:
        for name in ("every", "samples", "max_new_tokens"):
            require(getattr(self, name) >= 0, name, "must be >= 0")
        require(self.k >= 1, "k", "must be >= 1")
        require(self.workers >= 1, "workers", "must be >= 1")
        require(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        require(self.k == 1 or self.temperature > 0, "k",
                "> 1 needs eval.temperature > 0: greedy samples of one prompt are all the same")
        require(self.timeout_s > 0, "timeout_s", "must be > 0")

    @property
    def enabled(self) -> bool:
        return self.every > 0 or self.before_train


@dataclass
class TaskConfig:
    name: str = "moerl.tasks.arithmetic:ArithmeticTask"
    """dotted path module:Class of the task"""
    options: dict[str, Any] = field(default_factory=dict)
    """passed to the task's own config"""
    reward_timeout_s: float = 60.0
    """a reward call past this fails its sample (it cannot hold its worker)"""

    def validate(self) -> None:
        require(self.reward_timeout_s > 0, "reward_timeout_s", "must be > 0")


@dataclass
class CheckpointConfig:
    dir: str = ""
    """local path or s3://bucket/prefix; empty = <run.dir>/checkpoints"""
    every: int = 0
    """save every N optimizer steps; 0 = no periodic saves (the last step and a stop always save)"""
    hf_export: bool = False
    """also write every saved step as a Hugging Face directory, <run.dir>/hf/step-NNNNNNNN"""
    keep: int = 3
    """how many most recent checkpoints to keep"""
    timeout_s: float = 1800.0
    """one save (the trainer's upload included) may take this long before it counts as failed"""
    max_failures: int = 3
    """consecutive failed saves that end the run (a failed save is retried at the next interval)"""
    storage_timeout_s: float = 60.0
    """each storage call (a write, a read, a listing; S3 or local) may take this long: an endpoint that never
    answers fails the start-up probe, a save or an export within it, rather than freezing the run
    """

    def validate(self) -> None:
        require(self.every >= 0, "every", "must be >= 0 (0 = no periodic saves)")
        require(re.match(r"s3a?://[^/]", self.dir) is not None or not self.dir.startswith(("s3://", "s3a://")), "dir",
                "must be s3://bucket/prefix with a bucket named")
        scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", self.dir)
        require(scheme is None or scheme.group(1) in ("s3", "s3a"), "dir",
                f"has the scheme {scheme.group(1) + '://' if scheme else ''!r}, which moerl cannot store checkpoints "
                "through: a local path or s3://bucket/prefix")
        require(self.keep >= 1, "keep", "must be >= 1")
        require(self.timeout_s > 0, "timeout_s", "must be > 0")
        require(self.max_failures >= 1, "max_failures", "must be >= 1")
        require(self.storage_timeout_s > 0, "storage_timeout_s", "must be > 0")


@dataclass
class WeightsConfig:
    """Weight sync, trainer -> rollout workers (moerl/actors/weight_sync): how each version travels."""

    transport: Literal["auto", "object_store", "shared", "broadcast"] = "auto"
    """auto = "shared" for workers on a trainer rank's node and GPU, else "object_store"; shared = CUDA IPC (a
    /dev/shm file on CPU); broadcast = NCCL (gloo on CPU) from the trainer to the workers in buckets
    """
    bucket_mb: int = 256
    """bucket size: tensors are packed into flat buffers of about this many MiB"""
    timeout_s: float = 60.0
    """one transfer (a broadcast, a worker's apply) may take this long before it is abandoned"""

    def validate(self) -> None:
        require(self.bucket_mb >= 1, "bucket_mb", "must be >= 1")
        require(self.timeout_s > 0, "timeout_s", "must be > 0")


@dataclass
class RayConfig:
    address: str = ""
    """address of a Ray cluster to join; empty = start a local one"""
    num_cpus: int = 0
    """CPUs for a local Ray; 0 = let Ray decide"""
    connect_timeout_s: float = 5.0
    """before Ray starts, `address` (or RAY_ADDRESS) must accept a connection within this (Ray itself retried an
    unreachable address for minutes)
    """
    start_timeout_s: float = 300.0
    """starting the local Ray (or joining `address`) may take this long; past it the run stops, saying so (a run
    sat in Ray's start-up for over an hour on a loaded machine, holding its run lock)
    """

    def validate(self) -> None:
        require(self.connect_timeout_s > 0, "connect_timeout_s", "must be > 0")
        require(self.start_timeout_s > 0, "start_timeout_s", "must be > 0")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECRET_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")
_RESERVED_ENV = frozenset({"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "MOERL_CONFIG_B64"})


_TOLERATION = re.compile(r"[A-Za-z0-9./_-]+(=[A-Za-z0-9._-]*)?(:(NoSchedule|PreferNoSchedule|NoExecute))?")


@dataclass
class LaunchConfig:
    """`moerl launch` (moerl/launch, docs/eks.md): TorchX apps; on Kubernetes, Volcano jobs on EKS."""

    name: str = ""
    """jobs are <name>-trainer and <name>-rollout; empty = run.name"""
    image: str = ""
    """container image with moerl installed (required by the kubernetes scheduler)"""
    namespace: str = "default"
    """Kubernetes namespace of the jobs"""
    queue: str = "default"
    """Volcano queue"""
    service_account: str = ""
    """pods' service account (IRSA role for the S3 bucket); empty = the namespace's"""
    priority_class: str = ""
    """pods' PriorityClass; empty = none"""
    zone: str = ""
    """the one availability zone every pod is pinned to (required by the kubernetes scheduler)"""
    instance_type: str = "p5en.48xlarge"
    """node preset: p5.48xlarge | p5en.48xlarge | p6-b200.48xlarge"""
    trainer_nodes: int = 1
    """trainer pods, one per node; rank 0 runs the Ray head and the controller"""
    trainer_capacity: Literal["on_demand", "spot"] = "on_demand"
    """the trainer must be on-demand"""
    trainer_max_retries: int = 3
    """restarts of the whole trainer job after a pod fails or is evicted"""
    trainer_grace_s: int = 60
    """terminationGracePeriodSeconds of trainer pods"""
    rollout_nodes: int = 0
    """rollout pods (spot), one per node; 0 = no rollout job"""
    rollout_min_nodes: int = 1
    """the rollout job starts with this many pods; it grows to rollout_nodes"""
    rollout_instance_type: str = ""
    """empty = instance_type"""
    rollout_capacity: Literal["spot", "on_demand"] = "spot"
    """capacity type of the rollout nodes"""
    rollout_max_retries: int = 1000
    """restarts of one rollout pod (a spot reclaim is one)"""
    rollout_grace_s: int = 120
    """terminationGracePeriodSeconds of rollout pods (>= 90: two-minute spot notice)"""
    gpus_per_node: int = -1
    """GPUs per pod; -1 = all of the instance type"""
    efa_per_node: int = -1
    """EFA devices per pod; -1 = all of the instance type, 0 = none"""
    hugepages_mib: int = 5120
    """hugepages-2Mi per pod for libfabric, when EFA is requested"""
    cpus_per_node: float = 0.0
    """CPU request per pod; 0 = the preset's (vCPUs less room for daemons)"""
    memory_gib_per_node: int = 0
    """memory request per pod; 0 = the preset's"""
    tolerations: list[str] = field(default_factory=lambda: ["nvidia.com/gpu:NoSchedule"])
    """`key[=value][:effect]`"""
    env: dict[str, str] = field(default_factory=dict)
    """extra environment for every pod, printed in the manifests: a credential by its name (HF_TOKEN) or its value (a
    URL with a password, an sk-..., ghp_..., AKIA... token) is refused; such a variable goes in `secret_env`
    """
    secret_env: dict[str, str] = field(default_factory=dict)
    """environment from Kubernetes Secrets for every pod: NAME -> "secret-name/key" (valueFrom.secretKeyRef); the
    values never enter the manifests, the dry run or the config the pods receive (docs/eks.md)
    """
    volumes: dict[str, str] = field(default_factory=dict)
    """PersistentVolumeClaim name -> mount path"""
    ray_port: int = 6379
    """Ray head (GCS) port on trainer rank 0"""
    head_wait_s: int = 1800
    """a rollout pod without a Ray head this long exits (the trainer job is over)"""

    def validate(self) -> None:
        require(self.name == "" or re.fullmatch(r"[a-z]([a-z0-9-]{0,30}[a-z0-9])?", self.name) is not None,
                "name", "must be a DNS label of at most 32 characters (a-z, 0-9, -)")
        require(self.trainer_capacity == "on_demand", "trainer_capacity",
                "must be 'on_demand': the trainer restarts as a whole, so spot capacity is for rollout only")
        require(self.trainer_nodes >= 1, "trainer_nodes", "must be >= 1")
        require(self.rollout_nodes >= 0, "rollout_nodes", "must be >= 0")
        require(1 <= self.rollout_min_nodes <= max(self.rollout_nodes, 1), "rollout_min_nodes",
                "must be in [1, rollout_nodes]")
        require(self.rollout_grace_s >= 90, "rollout_grace_s", "must be >= 90 s (a spot worker hands back its work)")
        for key in ("trainer_max_retries", "rollout_max_retries", "trainer_grace_s", "hugepages_mib"):
            require(getattr(self, key) >= 0, key, "must be >= 0")
        require(self.hugepages_mib % 2 == 0, "hugepages_mib", "must be a multiple of 2 (2 MiB pages)")
        for key in ("gpus_per_node", "efa_per_node"):
            require(getattr(self, key) >= -1, key, "must be >= 0, or -1 for all of the instance type")
        for spec in self.tolerations:
            require(_TOLERATION.fullmatch(spec) is not None, "tolerations",
                    f"entry {spec!r} is not `key[=value][:NoSchedule|PreferNoSchedule|NoExecute]`")
        require(all(p.startswith("/") for p in self.volumes.values()), "volumes", "mount paths must be absolute")
        require(1 <= self.ray_port <= 65535, "ray_port", "must be a TCP port")
        for name, value in self.env.items():
            require(not looks_secret(name), "env", f"entry {name!r} looks like a credential: plain env is "
                    "printed in the manifests; put it in a Kubernetes Secret and name it in launch.secret_env")
            held = secret_in_value(str(value))  # a neutral name may hold one too (DATABASE_URL, an sk-... token)
            require(held is None, "env", f"entry {name!r} holds {held} (not shown): plain env is printed in the "
                    "manifests; put it in a Kubernetes Secret and name it in launch.secret_env")
        for name, ref in self.secret_env.items():
            require(_ENV_NAME.fullmatch(name) is not None, "secret_env",
                    f"name {name!r} is not an environment variable name")
            secret, _, key = ref.partition("/")
            require(_SECRET_NAME.fullmatch(secret) is not None and _SECRET_KEY.fullmatch(key) is not None,
                    "secret_env", f"entry {name!r} is not 'secret-name/key' (a Secret's DNS name, '/', a key of "
                    "it); its value is not shown, since it may be the secret itself")
            require(name not in self.env, "secret_env", f"entry {name!r} is also in launch.env")
            require(name not in _RESERVED_ENV, "secret_env", f"entry {name!r} is set by moerl launch itself")


@dataclass
class MoerlConfig:
    """A whole moerl job: every section below, each a TOML table (`[train]`, `[train.loss]`)."""

    run: RunConfig = field(default_factory=RunConfig)
    """The run's name, directory, seed, device and logging."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy: a Hugging Face Qwen3-MoE checkpoint or a random-init preset, its dtype and MoE routing."""
    ep: EPConfig = field(default_factory=EPConfig)
    """Expert parallelism of the trainer ranks."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout workers (one engine each): sampling, batching, KV cache, heartbeats, preemption."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The RL loop and the trainer ranks: steps, batches, staleness, parallelism, the warm start, guards."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Where and how often the run saves (a local path or s3://)."""
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    """How each policy version travels from the trainer to the rollout workers."""
    ray: RayConfig = field(default_factory=RayConfig)
    """The Ray instance: a local one, or a cluster to join."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The prompts and the reward (a Python class named by its dotted path)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Greedy (or sampled) evaluation on held-out prompts during training."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """`moerl launch`: TorchX apps, and on Kubernetes (EKS) the Volcano jobs of the trainer and the rollout."""

    def validate(self) -> None:
        # EP groups tile the trainer ranks: experts split over ep.size ranks, replicated (FSDP-sharded) over the rest
        require(self.train.num_ranks % self.ep.size == 0, "ep.size",
                f"must divide train.num_ranks ({self.train.num_ranks})")
        require(self.ep.size in (1, self.train.num_ranks) or self.train.data_parallel == "fsdp", "ep.size",
                "smaller than train.num_ranks needs train.data_parallel = 'fsdp' (the replicas of an expert "
                "slice are FSDP-sharded)")
        # The loss supports a k3 KL term, but the trainer keeps no frozen reference policy to compute it against.
        require(self.train.loss.kl_coef == 0, "train.loss.kl_coef",
                "must be 0: the trainer keeps no reference policy yet, so there is nothing to take a KL to")

    def checkpoint_dir(self) -> str:
        """`checkpoint.dir`, or `<run.dir>/checkpoints` when that is empty."""
        return self.checkpoint.dir or f"{self.run.dir.rstrip('/')}/checkpoints"


# ---------------------------------------------------------------------------------- public API
def load_config(path: str | Path | None, overrides: Sequence[str] = (),
                cls: type[T] = MoerlConfig) -> T:  # type: ignore[assignment]
    """Defaults, then the TOML file at `path` (None: defaults only), then `--dotted.key=value` overrides."""
    return config_loader.load_config(path, overrides, cls, MOVED_KEYS)


def config_from_dict(data: Mapping[str, Any], cls: type[T] = MoerlConfig, *,  # type: ignore[assignment]
                     source: str = "<dict>", validate: bool = True) -> T:
    """Build and type-check `cls` from nested mappings; missing keys keep their defaults."""
    return config_loader.config_from_dict(data, cls, source=source, validate=validate, moved=MOVED_KEYS)

