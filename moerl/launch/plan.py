"""From a moerl config to what `moerl launch` submits: TorchX apps, their Kubernetes shaping, and the checks.

Every check runs here, before anything is submitted; a failure is a `ConfigError` naming the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchx.specs import AppDef

from moerl.config import ConfigError, LaunchConfig, MoerlConfig
from moerl.launch.components import pod_config, resource, rollout, trainer_app
from moerl.launch.kubernetes import JobShape, head_address, token_secret
from moerl.launch.presets import PRESETS, SCHEDULERS, InstanceType

COMPLETE_ON_RANK0 = [{"event": "TaskCompleted", "action": "CompleteJob"}]
CAPACITY_TYPES = {"on_demand": "ON_DEMAND", "spot": "SPOT"}  # launch.*_capacity -> the EKS node label value
RESTART_POD = [{"event": "PodEvicted", "action": "RestartTask"}, {"event": "PodFailed", "action": "RestartTask"}]


@dataclass
class Planned:
    app: AppDef
    shape: JobShape | None = None  # kubernetes only


@dataclass
class Plan:
    scheduler: str
    apps: list[Planned]
    scheduler_cfg: dict[str, Any] = field(default_factory=dict)
    secret: dict[str, Any] | None = None  # Ray's auth token Secret, without its value (kubernetes; see cli.py)


def job_base_name(cfg: MoerlConfig) -> str:
    """`launch.name`, else `run.name` made a DNS label (lower case, [a-z0-9-], <= 32 characters)."""
    if cfg.launch.name:
        return cfg.launch.name
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.run.name.lower()).strip("-")[:32].strip("-")
    return name if name and name[0].isalpha() else f"moerl-{name}".strip("-")[:32]


def _fail(key: str, message: str) -> ConfigError:
    return ConfigError(f"config key {key!r} {message}")


def _instance(key: str, name: str) -> InstanceType:
    if name not in PRESETS:
        raise _fail(key, f"is {name!r}, not a known instance type (known: {', '.join(PRESETS)})")
    return PRESETS[name]


def _per_node(key: str, asked: int, has: int, what: str, itype: InstanceType) -> int:
    if asked > has:
        raise _fail(key, f"asks for {asked} {what} per node, but {itype.name} has {has}")
    return has if asked == -1 else asked


def check(cfg: MoerlConfig, scheduler: str) -> None:
    """The checks that need more than the `[launch]` section (scheduler, presets, other sections)."""
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"unknown scheduler {scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
    la = cfg.launch
    if scheduler != "kubernetes":
        return
    if not la.image:
        raise _fail("launch.image", "is required by the kubernetes scheduler (an image with moerl installed; "
                    "see docs/eks.md)")
    if not la.zone:
        raise _fail("launch.zone", "is required by the kubernetes scheduler: every pod is pinned to one "
                    "availability zone (e.g. us-east-2b)")
    if cfg.ray.address:
        raise _fail("ray.address", "must be empty: the launched job starts its own Ray head on trainer rank 0")
    if la.rollout_nodes and la.rollout_grace_s < cfg.rollout.grace_s + 20:
        raise _fail("launch.rollout_grace_s", f"({la.rollout_grace_s} s) must exceed rollout.grace_s "
                    f"({cfg.rollout.grace_s:g} s, the workers' hand-back) by at least 20 s (Ray's own stop)")
    itype = _instance("launch.instance_type", la.instance_type)
    gpus = _per_node("launch.gpus_per_node", la.gpus_per_node, itype.gpus, "GPUs", itype)
    _per_node("launch.efa_per_node", la.efa_per_node, itype.efa, "EFA devices", itype)
    need = cfg.train.num_ranks * cfg.train.gpus_per_rank
    if need > la.trainer_nodes * gpus:
        raise _fail("train.num_ranks", f"x train.gpus_per_rank needs {need:g} GPUs, but launch.trainer_nodes="
                    f"{la.trainer_nodes} x {gpus} GPUs per node have {la.trainer_nodes * gpus}")
    if la.rollout_nodes:
        ritype = _instance("launch.rollout_instance_type", la.rollout_instance_type or la.instance_type)
        rgpus = _per_node("launch.gpus_per_node", la.gpus_per_node, ritype.gpus, "GPUs", ritype)
        _per_node("launch.efa_per_node", la.efa_per_node, ritype.efa, "EFA devices", ritype)
        if cfg.rollout.ep_size > rgpus:  # a worker is one Ray actor: its engine group's GPUs are on one node
            raise _fail("rollout.ep_size", f"({cfg.rollout.ep_size} GPUs per rollout engine) exceeds the {rgpus} GPUs "
                        "of a rollout node: an engine group runs on one node")
        need = cfg.rollout.num_workers * cfg.rollout.gpus_per_worker
        if need > la.rollout_nodes * rgpus:
            raise _fail("rollout.num_workers", f"x rollout.gpus_per_worker needs {need:g} GPUs, but "
                        f"launch.rollout_nodes={la.rollout_nodes} x {rgpus} GPUs per node have {la.rollout_nodes * rgpus}")


def rollout_efa(la: LaunchConfig, ritype: InstanceType) -> int:
    """EFA devices per rollout pod, asked as a trainer pod asks (`launch.efa_per_node`; 0 turns EFA off for both).
    A rollout job's pods are always nodes other than the trainer's (only they carry the `rollout` Ray resource),
    so every weight version crosses nodes, and NCCL between them (the broadcast transport) needs EFA as the
    trainer's collectives do (the object store goes over TCP). An engine group (`rollout.ep_size`) never spans
    nodes: `check` refuses one larger than a node, so it needs no condition of its own here."""
    return ritype.efa if la.efa_per_node == -1 else la.efa_per_node


def plan(cfg: MoerlConfig, scheduler: str) -> Plan:
    """What to submit for `cfg` on `scheduler`; raises ConfigError for bad input."""
    check(cfg, scheduler)
    name, config_b64 = job_base_name(cfg), pod_config(cfg)
    if scheduler == "local_cwd":  # the trainer app only: rollout workers are actors in the local Ray
        return Plan(scheduler, [Planned(trainer_app(config_b64, name, mode="local"))],
                    {"log_dir": str(Path(cfg.run.dir).absolute() / "torchx")})
    la = cfg.launch
    itype = PRESETS[la.instance_type]
    gpus = itype.gpus if la.gpus_per_node == -1 else la.gpus_per_node
    efa = itype.efa if la.efa_per_node == -1 else la.efa_per_node
    res = resource(la.cpus_per_node or itype.pod_cpus, gpus, la.memory_gib_per_node or itype.pod_memory_gib,
                   efa, itype.name)
    secret = f"{name}-ray-token"
    common: dict[str, Any] = {"zone": la.zone, "namespace": la.namespace, "tolerations": list(la.tolerations),
                              "volumes": dict(la.volumes), "token_secret": secret,
                              "secret_env": {k: tuple(v.split("/", 1)) for k, v in la.secret_env.items()}}
    trainer_job = f"{name}-trainer"
    apps = [Planned(trainer_app(config_b64, name, la.image, la.trainer_nodes, "cluster", res, la.ray_port,
                                la.trainer_max_retries, la.head_wait_s, dict(la.env), grace_s=la.trainer_grace_s),
                    JobShape(trainer_job, CAPACITY_TYPES[la.trainer_capacity], grace_s=la.trainer_grace_s, min_available=la.trainer_nodes,
                             hugepages_mib=la.hugepages_mib if efa else 0, rank0_policies=COMPLETE_ON_RANK0,
                             **common))]
    if la.rollout_nodes:
        ritype = PRESETS[la.rollout_instance_type or la.instance_type]
        rgpus = ritype.gpus if la.gpus_per_node == -1 else la.gpus_per_node
        refa = rollout_efa(la, ritype)  # with it, the EFA env (components.EFA_ENV) and hugepages, as the trainer's
        app = rollout(head_address(trainer_job, la.namespace, la.ray_port), la.image, la.rollout_nodes,
                      la.rollout_min_nodes, name, ritype.name, rgpus, refa, la.cpus_per_node or ritype.pod_cpus,
                      la.memory_gib_per_node or ritype.pod_memory_gib, la.rollout_grace_s, la.rollout_max_retries,
                      la.head_wait_s, dict(la.env))
        apps.append(Planned(app, JobShape(f"{name}-rollout", CAPACITY_TYPES[la.rollout_capacity], grace_s=la.rollout_grace_s,
                                          min_available=la.rollout_min_nodes, policies=RESTART_POD,
                                          hugepages_mib=la.hugepages_mib if refa else 0, **common)))
    opts = {"namespace": la.namespace, "queue": la.queue}
    opts.update({k: v for k, v in (("service_account", la.service_account),
                                   ("priority_class", la.priority_class)) if v})
    return Plan(scheduler, apps, opts, token_secret(secret, la.namespace))
