"""`moerl launch CONFIG --scheduler {local_cwd,kubernetes} [--dryrun] [--section.key=value ...]`

    moerl launch configs/demo.toml --scheduler local_cwd --train.steps=5       # the demo through TorchX
    moerl launch configs/eks-p5en.toml --scheduler kubernetes --dryrun        # print the manifests (YAML)
    moerl launch configs/eks-p5en.toml --scheduler kubernetes                 # submit (docs/eks.md)

On kubernetes: a Secret with Ray's auth token, the trainer Volcano job and the rollout Volcano job (TorchX's
requests, shaped by launch/kubernetes.py). `--dryrun` prints the jobs as YAML documents (`kubectl apply -f -`
takes them as they are) and submits nothing. On local_cwd: the trainer app only, its log followed here.

No secret value is ever printed. The token is generated only when a real launch creates its Secret (and a
relaunch keeps the existing one); the dry run prints no Secret document, only a YAML comment with the
`kubectl create secret generic ...` line that makes one with a random token. (A Secret document without its
value would apply as an empty Secret: the pods would fail on the missing key, and the `kubectl create` after it
on AlreadyExists.) `launch.secret_env` entries are `secretKeyRef`s to Secrets the user creates.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from moerl.config import ConfigError, load_config


def _manifests(runner: Any, plan: Any) -> list[tuple[Any, dict[str, Any] | None]]:
    """(dry-run info, shaped Volcano Job or None) per app; the info's request now holds the shaped job."""
    from moerl.launch.kubernetes import shape_job

    out = []
    for planned in plan.apps:
        with warnings.catch_warnings():  # TorchX warns of Volcano retries for every task (volcano#1651)
            warnings.filterwarnings("ignore", message=r"\s*Role \S+ configured with restarts")
            info = runner.dryrun(planned.app, plan.scheduler, cfg=plan.scheduler_cfg)
        job = None
        if planned.shape is not None:
            job = info.request.resource = shape_job(info.request.resource, planned.shape)
        out.append((info, job))
    return out


def kubernetes_manifests(plan: Any) -> list[dict[str, Any]]:
    """The Secret (without its token) and the Volcano Jobs that `plan` submits, without submitting them."""
    from torchx.runner import get_runner

    with get_runner() as runner:
        return [plan.secret, *(job for _, job in _manifests(runner, plan))]


FLEET_ANNOTATION = "moerl.dev/fleet-growth"  # on the rollout job: how its workers come up (`fleet_growth`)


def fleet_growth(cfg: Any) -> str:
    """How the rollout fleet grows, in one line ("" without rollout nodes): rollout.min_workers up before leases
    start, on the launch.rollout_min_nodes the job starts with; the rest wait for capacity (moerl/actors/pools.py)
    and join as spot nodes come. Says so when the first nodes cannot hold min_workers (the run would stop after
    rollout.start_timeout_s unless more nodes come by then)."""
    from moerl.launch.presets import PRESETS

    la, ro = cfg.launch, cfg.rollout
    if not la.rollout_nodes:
        return ""
    itype = PRESETS.get(la.rollout_instance_type or la.instance_type)
    gpus = la.gpus_per_node if la.gpus_per_node != -1 or itype is None else itype.gpus
    per_node = int(gpus // ro.gpus_per_worker) if ro.gpus_per_worker > 0 else 0
    first = (f" ({la.rollout_min_nodes * per_node} workers at {per_node} per node)" if per_node else "")
    line = (f"rollout fleet: leases start once rollout.min_workers={ro.min_workers} of rollout.num_workers="
            f"{ro.num_workers} workers are up; the rollout job starts with launch.rollout_min_nodes="
            f"{la.rollout_min_nodes} {la.rollout_capacity} nodes{first} and grows to launch.rollout_nodes="
            f"{la.rollout_nodes} as capacity comes; the other {ro.num_workers - ro.min_workers} workers wait for "
            "capacity, without a deadline, and join as their nodes come")
    if per_node and ro.min_workers > la.rollout_min_nodes * per_node:
        line += (f". warning: the first {la.rollout_min_nodes} nodes hold {la.rollout_min_nodes * per_node} workers, "
                 f"fewer than rollout.min_workers: the run stops unless more nodes come within "
                 f"rollout.start_timeout_s={ro.start_timeout_s:g} s")
    return line


def dryrun_header(plan: Any, growth: str = "") -> str:
    """YAML comments before the dry run's documents: how to make the token Secret; which Secrets must exist; how
    the rollout fleet grows (`fleet_growth`)."""
    from moerl.launch.kubernetes import create_secret_command

    lines = ["moerl launch --dryrun: nothing was submitted; `kubectl apply -f -` takes these as they are.",
             "Ray's auth token is not printed. Create its Secret once, before applying (a real launch does):",
             f"  {create_secret_command(plan.secret)}"]
    if growth:
        lines.append(growth)
    refs = sorted({(k, v) for p in plan.apps if p.shape for k, v in p.shape.secret_env.items()})
    if refs:
        lines.append(f"These Secrets (launch.secret_env) must exist in namespace {plan.secret['metadata']['namespace']}:")
        lines += [f"  {env} <- secret {name!r}, key {key!r}" for env, (name, key) in refs]
    return "".join(f"# {line}\n" for line in lines)


def _core_api() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()


def _create_secret(secret: dict[str, Any]) -> None:
    """Create Ray's token Secret with a fresh random token; an existing one (a relaunch) is kept."""
    from kubernetes import client

    from moerl.launch.kubernetes import with_token

    try:
        _core_api().create_namespaced_secret(secret["metadata"]["namespace"], with_token(secret))
    except client.ApiException as e:
        if e.status != 409:  # it exists: a relaunch keeps the token
            raise RuntimeError(f"cannot create Secret {secret['metadata']['name']}: HTTP {e.status} {e.reason}") from None


def _missing_secrets(plan: Any) -> list[str]:
    """`launch.secret_env` references whose Secret or key is missing (checked by key name; values are not read
    out). A 403 (no `get` on Secrets) skips the check."""
    from kubernetes import client

    namespace = plan.scheduler_cfg["namespace"]
    refs = {(k, v) for p in plan.apps if p.shape for k, v in p.shape.secret_env.items()}
    if not refs:
        return []
    api, found, missing = _core_api(), {}, []
    for env, (name, key) in sorted(refs):
        if name not in found:
            try:
                found[name] = set((api.read_namespaced_secret(name, namespace).data or {}).keys())
            except client.ApiException as e:
                if e.status == 403:
                    print(f"warning: cannot read Secrets in {namespace} to check launch.secret_env", file=sys.stderr)
                    return []
                if e.status != 404:
                    raise RuntimeError(f"cannot read Secret {name}: HTTP {e.status} {e.reason}") from None
                found[name] = None
        if found[name] is None or key not in found[name]:
            missing.append(f"launch.secret_env {env}: Secret {name!r} in namespace {namespace} "
                           f"{'does not exist' if found[name] is None else f'has no key {key!r}'}")
    return missing


def _local(runner: Any, info: Any) -> int:
    from torchx.specs import AppState

    handle = runner.schedule(info)
    print(f"launched {handle}", flush=True)
    for line in runner.log_lines(handle, "trainer", 0, should_tail=True):
        print(line, end="" if line.endswith("\n") else "\n", flush=True)
    status = runner.wait(handle, wait_interval=1)
    print(f"{handle}: {status.state if status else 'unknown'}")
    return 0 if status and status.state == AppState.SUCCEEDED else 1


def main(argv: list[str]) -> int:
    from moerl.launch.presets import SCHEDULERS

    parser = argparse.ArgumentParser(prog="moerl launch", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="moerl TOML config")
    parser.add_argument("--scheduler", required=True, choices=SCHEDULERS)
    parser.add_argument("--dryrun", action="store_true", help="print what would be submitted; submit nothing")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--") and "." in o.partition("=")[0])]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (overrides are --section.key=value)")
    from moerl.launch.plan import plan as make_plan

    try:
        cfg = load_config(args.config, overrides)
        plan = make_plan(cfg, args.scheduler)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from torchx.runner import get_runner

    from moerl.launch.kubernetes import to_yaml

    with get_runner() as runner:
        infos = _manifests(runner, plan)
        if args.scheduler == "local_cwd":
            if args.dryrun:
                print("\n".join(str(info) for info, _ in infos))
                return 0
            return _local(runner, infos[0][0])
        jobs = [job for _, job in infos if job is not None]
        assert plan.secret is not None and len(jobs) == len(infos), "a kubernetes plan shapes every job"
        growth = fleet_growth(cfg)
        for job in jobs[1:]:  # the rollout job (after the trainer's): submitted with it too, for kubectl describe
            job["metadata"].setdefault("annotations", {})[FLEET_ANNOTATION] = growth
        if args.dryrun:
            print(dryrun_header(plan, growth) + to_yaml(jobs), end="")
            return 0
        missing = _missing_secrets(plan)
        if missing:
            print("error: " + "; ".join(missing) + " (kubectl create secret generic NAME -n NAMESPACE "
                  "--from-literal=KEY=...)", file=sys.stderr)
            return 2
        _create_secret(plan.secret)
        namespace = plan.scheduler_cfg["namespace"]
        for (info, _), job in zip(infos, jobs):
            name = job["metadata"]["name"]
            try:
                print(f"submitted {runner.schedule(info)}  (kubectl get vcjob {name} -n {namespace})", flush=True)
            except ValueError as e:  # TorchX: the job exists (409)
                print(f"error: {e}; delete it first: kubectl delete vcjob {name} -n {namespace}", file=sys.stderr)
                return 1
    return 0
