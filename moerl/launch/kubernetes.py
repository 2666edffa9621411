"""What TorchX 0.7's kubernetes scheduler cannot say, added to its Volcano Job request before it is scheduled.

TorchX emits one Volcano task per replica (`<role>-<i>`) and selects the instance type only. `shape_job`
takes the dry-run request (`AppDryRunInfo.request.resource`) and adds:

- a fixed job name (`<launch.name>-trainer` / `-rollout`, instead of TorchX's random suffix), so the rollout
  pods can find the Ray head: Volcano's `svc` plugin gives each job a headless Service named after it and
  each pod the hostname `<job>-<task>-0`, so trainer rank 0 is
  `<name>-trainer-trainer-0-0.<name>-trainer.<namespace>.svc.cluster.local` (`head_address`);
- the `svc` plugin's `--disable-network-policy`: its default NetworkPolicy admits only the job's own pods,
  and the rollout job's pods must reach the Ray head (and it them);
- nodeSelector `eks.amazonaws.com/capacityType` (ON_DEMAND / SPOT) and `topology.kubernetes.io/zone`,
  tolerations, `terminationGracePeriodSeconds`, hugepages-2Mi (libfabric, with EFA), PVC volumes;
- Ray token authentication: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret (`token_secret`), and
  `launch.secret_env` as `valueFrom.secretKeyRef`: no secret value is ever written into a manifest;
- Volcano policies: trainer rank 0 finishing completes the job (TaskCompleted -> CompleteJob); a rollout
  pod failed or evicted (spot) is restarted alone (RestartTask); `minAvailable` gangs the trainer pods.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

CAPACITY_LABEL = "eks.amazonaws.com/capacityType"
ZONE_LABEL = "topology.kubernetes.io/zone"
HUGEPAGES = "hugepages-2Mi"


@dataclass
class JobShape:
    job_name: str
    capacity: str  # ON_DEMAND | SPOT
    zone: str
    grace_s: int
    min_available: int
    namespace: str = ""  # written into the job, so the dry run's YAML applies as it is
    tolerations: list[str] = field(default_factory=list)  # `key[=value][:effect]`
    hugepages_mib: int = 0
    volumes: dict[str, str] = field(default_factory=dict)  # PVC claim -> mount path
    token_secret: str = ""  # Secret with key `token`: Ray's auth token
    secret_env: dict[str, tuple[str, str]] = field(default_factory=dict)  # env name -> (Secret, key)
    policies: list[dict[str, str]] = field(default_factory=list)  # replace every task's Volcano policies
    rank0_policies: list[dict[str, str]] = field(default_factory=list)  # added to task 0's


def head_address(trainer_job: str, namespace: str, port: int) -> str:
    return f"{trainer_job}-trainer-0-0.{trainer_job}.{namespace}.svc.cluster.local:{port}"


def toleration(spec: str) -> dict[str, str]:
    """`key[=value][:effect]` (kubectl taint syntax) as a Kubernetes toleration."""
    keyval, _, effect = spec.partition(":")
    key, eq, value = keyval.partition("=")
    out = {"key": key, "operator": "Equal" if eq else "Exists"}
    if eq:
        out["value"] = value
    if effect:
        out["effect"] = effect
    return out


def token_secret(name: str, namespace: str) -> dict[str, Any]:
    """The Secret for Ray's auth token, without the token: only `with_token` (a real launch) adds one."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "moerl"}}}


def with_token(secret: dict[str, Any]) -> dict[str, Any]:
    """`secret` with a fresh random token (32 bytes, hex): created in the cluster, never printed."""
    return {**secret, "stringData": {"token": secrets.token_hex(32)}}


def create_secret_command(secret: dict[str, Any]) -> str:
    """The one-line kubectl command that creates `secret` with a random token (what a real launch does)."""
    meta = secret["metadata"]
    return (f"kubectl create secret generic {meta['name']} -n {meta['namespace']} "
            f'--from-literal=token="$(openssl rand -hex 32)"')


def _replace(obj: Any, old: str, new: str) -> Any:
    if isinstance(obj, str):
        return obj.replace(old, new)
    if isinstance(obj, list):
        return [_replace(v, old, new) for v in obj]
    if isinstance(obj, dict):
        return {k: _replace(v, old, new) for k, v in obj.items()}
    return obj


def plain(resource: dict[str, Any]) -> dict[str, Any]:
    """The request with its kubernetes-client objects (V1Pod templates) as plain dicts."""
    from torchx.schedulers.kubernetes_scheduler import sanitize_for_serialization

    return sanitize_for_serialization(resource)  # type: ignore[return-value]


def shape_job(resource: dict[str, Any], shape: JobShape) -> dict[str, Any]:
    """A new, plain-dict Volcano Job: `resource` (TorchX's request) with what `shape` adds."""
    job = plain(resource)
    job = _replace(job, job["metadata"]["name"], shape.job_name)  # name, instance label, TORCHX_JOB_ID
    if shape.namespace:
        job["metadata"]["namespace"] = shape.namespace
    spec = job["spec"]
    spec["minAvailable"] = shape.min_available
    spec["plugins"]["svc"] = sorted(set(spec["plugins"].get("svc", [])) | {"--disable-network-policy"})
    for i, task in enumerate(spec["tasks"]):
        if shape.policies:
            task["policies"] = [dict(p) for p in shape.policies]
        if i == 0 and shape.rank0_policies:
            task["policies"] = [*task.get("policies", []), *(dict(p) for p in shape.rank0_policies)]
        _shape_pod(task["template"]["spec"], shape)
    return job


def _shape_pod(pod: dict[str, Any], shape: JobShape) -> None:
    pod.setdefault("nodeSelector", {}).update({CAPACITY_LABEL: shape.capacity, ZONE_LABEL: shape.zone})
    pod["terminationGracePeriodSeconds"] = shape.grace_s
    if shape.tolerations:
        pod["tolerations"] = [toleration(t) for t in shape.tolerations]
    for claim, path in shape.volumes.items():
        name = f"pvc-{claim}"[:63]
        pod.setdefault("volumes", []).append({"name": name, "persistentVolumeClaim": {"claimName": claim}})
        for c in pod["containers"]:
            c.setdefault("volumeMounts", []).append({"name": name, "mountPath": path})
    for c in pod["containers"]:
        if shape.hugepages_mib:
            for kind in ("requests", "limits"):  # hugepages: requests == limits
                c.setdefault("resources", {}).setdefault(kind, {})[HUGEPAGES] = f"{shape.hugepages_mib}Mi"
        if shape.token_secret:
            c.setdefault("env", []).extend([
                {"name": "RAY_AUTH_MODE", "value": "token"},
                {"name": "RAY_AUTH_TOKEN",
                 "valueFrom": {"secretKeyRef": {"name": shape.token_secret, "key": "token"}}}])
        c.setdefault("env", []).extend(
            {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
            for env, (secret, key) in shape.secret_env.items())


def to_yaml(docs: list[dict[str, Any]]) -> str:
    """YAML documents (`---` separated, no anchors/aliases, keys in their order)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, explicit_start=True)


def pod_templates(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Each task's pod template as a standalone `v1/Pod` (what kubernetes-validate can check strictly)."""
    return [{"apiVersion": "v1", "kind": "Pod",
             "metadata": {**task["template"].get("metadata", {}), "name": f"{job['metadata']['name']}-{task['name']}-0"},
             "spec": task["template"]["spec"]} for task in job["spec"]["tasks"]]
