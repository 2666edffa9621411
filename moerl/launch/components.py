"""TorchX components of a moerl job: `trainer` and `rollout`, each one app with one role of that name.

    torchx run -s local_cwd moerl.launch.components:trainer --config configs/demo.toml \\
        --overrides train.steps=2,train.sft_steps=2
    torchx run -s kubernetes --scheduler_args queue=default moerl.launch.components:rollout \\
        --head moerl-trainer-trainer-0-0.moerl-trainer.default.svc.cluster.local:6379 --image IMAGE --nodes 4

The trainer app runs `moerl train` on the config (read here, resolved with the overrides, and shipped in
$MOERL_CONFIG_B64 without `launch.env`/`launch.secret_env`): in `local` mode as one process with its own Ray; in `cluster` mode rank 0 starts the
Ray head and runs the controller and the other ranks join it. It restarts as a whole (max_retries, the
APPLICATION retry policy). The rollout app's pods join that Ray cluster with the `rollout` resource and
are retried one by one (REPLICA), elastically from `min_nodes`. TorchX has no field for capacity type,
zone, tolerations or grace periods: `moerl launch` adds those to the Kubernetes request (launch/kubernetes.py).
TorchX's component linter reads these signatures: keep typing.Optional/List/Dict here, not `X | None`.
"""

# ruff: noqa: UP006, UP035, UP045 - TorchX 0.7's component linter needs typing.Optional/List/Dict
import dataclasses
import os
import sys
from typing import Any, Dict, List, Optional

from torchx import specs

from moerl.launch.node import CONFIG_ENV, encode_config

TRAINER, ROLLOUT = "trainer", "rollout"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}  # aws-ofi-nccl >= 1.6 picks NCCL_PROTO itself


def pod_config(cfg: Any) -> str:
    """What the pods receive in $MOERL_CONFIG_B64: the resolved config without `launch.env` and
    `launch.secret_env` (the pods get those as their environment, and their values must not travel in a
    base64 string that anyone who can read the Volcano job decodes)."""
    from moerl.config import dump_toml

    launch = dataclasses.replace(cfg.launch, env={}, secret_env={})
    return encode_config(dump_toml(dataclasses.replace(cfg, launch=launch)))


def resource(cpu: float, gpus: int, memory_gib: float, efa: int, instance_type: str) -> specs.Resource:
    return specs.Resource(cpu=cpu, gpu=gpus, memMB=int(memory_gib * 2**30 / 1e6),  # TorchX writes "<memMB>M"
                          capabilities={INSTANCE_TYPE_LABEL: instance_type} if instance_type else {},
                          devices={EFA_RESOURCE: efa} if efa else {})


def trainer_app(config_b64: str, name: str, image: str = "", nodes: int = 1, mode: str = "local",
                res: Optional[specs.Resource] = None, ray_port: int = 6379, max_retries: int = 0,
                wait_s: int = 1800, env: Optional[Dict[str, str]] = None, python: str = "",
                grace_s: int = 60) -> specs.AppDef:
    """The trainer app for an already resolved config (`pod_config(cfg)`)."""
    if mode not in ("local", "cluster"):
        raise ValueError(f"trainer mode must be 'local' or 'cluster', got {mode!r}")
    if mode == "local" and nodes != 1:
        raise ValueError("trainer mode 'local' runs one process (nodes=1); use mode 'cluster' for more nodes")
    args = ["-m", "moerl.launch.node", "train"] if mode == "local" else [
        "-m", "moerl.launch.node", "trainer", "--rank", specs.macros.replica_id, "--nodes", str(nodes),
        "--port", str(ray_port), "--head-env", specs.macros.rank0_env, "--wait-s", str(wait_s),
        "--grace-s", str(grace_s)]
    efa = (res.devices.get(EFA_RESOURCE, 0) if res else 0)
    role = specs.Role(name=TRAINER, image=image, entrypoint=python or (sys.executable if mode == "local" else "python"),
                      args=args, env={**(EFA_ENV if efa else {}), **(env or {}), CONFIG_ENV: config_b64,
                                      **({"PATH": os.environ.get("PATH", "")} if mode == "local" else {})},
                      num_replicas=nodes, max_retries=max_retries, retry_policy=specs.RetryPolicy.APPLICATION,
                      resource=res or specs.Resource(cpu=1, gpu=0, memMB=1024), port_map={"ray": ray_port})
    return specs.AppDef(name=f"{name}-{TRAINER}", roles=[role])


def trainer(
    config: str,
    image: str = "",
    nodes: int = 1,
    mode: str = "local",
    name: str = "",
    instance_type: str = "",
    gpus: int = 0,
    efa: int = 0,
    cpu: float = 1.0,
    memory_gib: float = 4.0,
    ray_port: int = 6379,
    max_retries: int = 0,
    wait_s: int = 1800,
    env: Optional[Dict[str, str]] = None,
    overrides: Optional[List[str]] = None,
    python: str = "",
) -> specs.AppDef:
    """The trainer app: `moerl train` on fixed capacity; rank 0 is the Ray head and runs the controller.

    Args:
        config: moerl TOML config file (read and shipped with the job)
        image: container image with moerl installed (ignored by local_cwd)
        nodes: trainer pods/nodes
        mode: local (one process, its own Ray) or cluster (rank 0 Ray head, other ranks join)
        name: job base name (default: run.name)
        instance_type: node.kubernetes.io/instance-type to select
        gpus: GPUs per pod
        efa: EFA devices per pod (vpc.amazonaws.com/efa)
        cpu: CPUs per pod
        memory_gib: memory per pod in GiB
        ray_port: Ray head port on rank 0
        max_retries: restarts of the whole app
        wait_s: how long rank 0 waits for the other nodes (and they for it)
        env: extra environment variables
        overrides: config overrides, `section.key=value` (comma-separated)
        python: interpreter to run (default: this one in local mode, `python` in cluster mode)
    """
    from moerl.config import MoerlConfig, load_config

    cfg: MoerlConfig = load_config(config, overrides or [])
    return trainer_app(pod_config(cfg), name or cfg.run.name, image, nodes, mode,
                       resource(cpu, gpus, memory_gib, efa, instance_type), ray_port, max_retries, wait_s, env,
                       python)


def rollout(
    head: str,
    image: str = "",
    nodes: int = 1,
    min_nodes: int = 0,
    name: str = "moerl",
    instance_type: str = "",
    gpus: int = 0,
    efa: int = 0,
    cpu: float = 1.0,
    memory_gib: float = 4.0,
    grace_s: int = 120,
    max_retries: int = 1000,
    wait_s: int = 1800,
    env: Optional[Dict[str, str]] = None,
    python: str = "python",
) -> specs.AppDef:
    """The rollout app: spot pods that join the Ray cluster with the `rollout` resource, retried one by one.

    Args:
        head: HOST:PORT of the Ray head (trainer rank 0)
        image: container image with moerl installed (ignored by local_cwd)
        nodes: rollout pods/nodes
        min_nodes: pods the app needs to start, elastic above (0: all of them)
        name: job base name
        instance_type: node.kubernetes.io/instance-type to select
        gpus: GPUs per pod
        efa: EFA devices per pod (vpc.amazonaws.com/efa)
        cpu: CPUs per pod
        memory_gib: memory per pod in GiB
        grace_s: the pod's termination grace period: workers get SIGTERM first and hand back their work
        max_retries: restarts of one pod
        wait_s: a pod with no Ray head this long exits (the trainer job is over)
        env: extra environment variables
        python: interpreter to run
    """
    args = ["-m", "moerl.launch.node", "rollout", "--head", head, "--rollout-resource", str(max(gpus, 1)),
            "--grace-s", str(grace_s), "--wait-s", str(wait_s)]
    role = specs.Role(name=ROLLOUT, image=image, entrypoint=python, args=args,
                      env={**(EFA_ENV if efa else {}), **(env or {})}, num_replicas=nodes,
                      min_replicas=min_nodes or None, max_retries=max_retries, retry_policy=specs.RetryPolicy.REPLICA,
                      resource=resource(cpu, gpus, memory_gib, efa, instance_type))
    return specs.AppDef(name=f"{name}-{ROLLOUT}", roles=[role])
