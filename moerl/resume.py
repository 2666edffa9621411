"""What `--resume` restores, and which config changes it accepts (issue 27 item 2).

Every checkpoint's COMMIT records the run's config (`saved_config`, secrets masked). On `--resume` the config
of the resuming command is compared with it, key by key:

- a key that changes the experiment (the model, the task, the group size, the loss, the optimizer, the
  sampling, the seed, ...) is refused unless named with `--resume-override KEY` (repeatable; a section such as
  `train.optim` names all its keys), every difference listed in one error;
- a key that does not (how many steps, where and with how many workers it runs, what is logged, evals,
  checkpoints, timeouts: `OPERATIONAL`) is accepted and said.

`statement` is what the run says before Ray starts: the step and samples it restores, the steps it rolls back
(their rows in metrics.jsonl and trajectories.jsonl are dropped and trained again), a newer save that did not
finish, and the changed keys. A checkpoint at or past `train.steps` is not resumed silently: past it is refused,
at it there is nothing to train (`complete`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from moerl.config import MoerlConfig, config_to_dict
from moerl.preflight import PreflightError
from moerl.redact import redact_config

# Keys (or whole sections) whose change leaves the experiment as it was: its length, its placement and scale,
# what is logged and evaluated, how it is checkpointed, timeouts and failure bounds. Any other key changes it.
OPERATIONAL = (
    "run.name", "run.dir", "run.device", "run.log_level", "run.wandb", "run.wandb_project", "run.wandb_name",
    "run.wandb_mode",
    "train.steps", "train.time_limit_s", "train.cpus_per_rank", "train.gpus_per_rank", "train.threads",
    "train.collective_timeout_s", "train.start_timeout_s", "train.micro_batch_tokens", "train.activation_checkpointing", "train.data_parallel",
    "train.reduce_grads_once",
    "train.behaviour_kl_bound", "train.health", "train.step_timeout_s", "train.max_failed_fraction", "train.failure_window",
    "rollout.num_workers", "rollout.cpus_per_worker", "rollout.gpus_per_worker", "rollout.threads",
    "rollout.heartbeat_s", "rollout.heartbeat_timeout_s", "rollout.start_timeout_s", "rollout.lease_timeout_s",
    "rollout.grace_s", "rollout.imds_url", "rollout.max_batch_size", "rollout.kv_cache_tokens",
    "rollout.gpu_memory_fraction", "rollout.kv_block_size", "rollout.prefix_caching", "rollout.max_inflight_groups",
    "rollout.max_attempts", "rollout.max_worker_losses", "rollout.respawn_backoff_s", "rollout.respawn_backoff_max_s",
    "eval", "checkpoint", "weights", "ray", "launch",
)


def saved_config(cfg: MoerlConfig) -> dict[str, Any]:
    """The config as a checkpoint records it: plain data, secrets masked (a manifest is read by anyone who can
    read the bucket)."""
    return redact_config(config_to_dict(cfg))


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _named(key: str, names: Iterable[str]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any],
                   overrides: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """(accepted, refused) changes from `saved` to `current`, each `key old -> new`. Keys one side lacks (a
    config of another moerl version) are not compared."""
    old, new = _flat(saved), _flat(current)
    accepted, refused = [], []
    for key in sorted(old.keys() & new.keys()):
        if old[key] == new[key]:
            continue
        line = f"{key} {old[key]!r} -> {new[key]!r}"
        (accepted if _named(key, OPERATIONAL) or _named(key, overrides) else refused).append(line)
    # a table emptied or filled (task.options = {} against {max_operand = 9}) shows as keys on one side only
    for key in sorted((old.keys() ^ new.keys())):
        table = key.rsplit(".", 1)[0]
        if table in old or table in new:  # an empty table on the other side: a real change
            line = f"{key} {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}"
            (accepted if _named(key, OPERATIONAL) or _named(key, overrides) else refused).append(line)
    return accepted, refused


def check_config(manifest: Mapping[str, Any], cfg: MoerlConfig, step: int, overrides: Iterable[str] = ()) -> list[str]:
    """The accepted changes (to be said); PreflightError listing every refused one. A checkpoint without a
    recorded config (an older moerl) is compared by its fingerprint only (moerl/preflight.py)."""
    overrides = list(overrides)
    known = _flat(config_to_dict(cfg))
    unknown = [k for k in overrides if not any(_named(key, [k]) for key in known)]
    if unknown:
        raise PreflightError(f"--resume-override {unknown[0]}: not a config key or section")
    saved = manifest.get("config")
    if not isinstance(saved, Mapping):
        return []
    accepted, refused = config_changes(saved, saved_config(cfg), overrides)
    if refused:
        keys = [line.split(" ", 1)[0] for line in refused]
        raise PreflightError(
            f"--resume: checkpoint step {step} was trained with another experiment: {'; '.join(refused)}; to resume "
            f"with the change anyway name each key ({' '.join('--resume-override ' + k for k in keys)}), or start a "
            "new run with --run.dir=<another directory>")
    return accepted


def complete(step: int, cfg: MoerlConfig) -> bool:
    """True when checkpoint `step` is train.steps already (nothing to train); PreflightError when it is past it:
    `--resume --train.steps=62` of a run saved at step 100 would cut its metrics back to step 62."""
    if step > cfg.train.steps:
        raise PreflightError(f"--resume: checkpoint step {step} is past train.steps={cfg.train.steps}: resuming would "
                             f"train nothing and cut the run's logs back; set --train.steps above {step} to train on")
    return step == cfg.train.steps


def statement(step: int, manifest: Mapping[str, Any], last_logged: int, newer_unsaved: list[int],
              changes: list[str], root: str) -> list[str]:
    """The lines `--resume` says before anything starts: what it restores, what it rolls back, what changed."""
    samples = manifest.get("trained", {}).get("samples") if isinstance(manifest.get("trained"), Mapping) else None
    lines = [f"resuming from checkpoint step {step} under {root}"
             + (f" ({samples} samples trained)" if isinstance(samples, int) else "")]
    if newer_unsaved:
        lines.append(f"step {newer_unsaved[-1]}'s save did not finish (never committed): step {step} is the newest "
                     "intact checkpoint")
    if last_logged > step:
        lines.append(f"rolling back {last_logged - step} logged step{'s' * (last_logged - step > 1)} "
                     f"({step + 1}-{last_logged}): their rows in metrics.jsonl and trajectories.jsonl are dropped, "
                     "and they are trained again")
    if changes:
        lines.append(f"config changed since step {step} (not the experiment): {', '.join(changes)}")
    return lines
