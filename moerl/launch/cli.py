"""`moerl launch CONFIG --scheduler {local_cwd,kubernetes} [--dryrun] [--section.key=value ...]`

    moerl launch configs/demo.toml --scheduler local_cwd --train.steps=5       # the demo through TorchX
    moerl launch configs/eks-p5en.toml --scheduler kubernetes --dryrun        # print the manifests (YAML)
    moerl launch configs/eks-p5en.toml --scheduler kubernetes                 # submit (docs/eks.md)

On kubernetes: a Secret with Ray's auth token, the trainer Volcano job and the rollout Volcano job (TorchX's
requests, shaped by launch/kubernetes.py). `--dryrun` prints them as YAML documents (`kubectl apply -f -`
takes them as they are) and submits nothing. On local_cwd: the trainer app only, its log followed here.
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
    """The Secret and the Volcano Jobs that `plan` submits, without submitting them."""
    from torchx.runner import get_runner

    with get_runner() as runner:
        return [plan.secret, *(job for _, job in _manifests(runner, plan))]


def _create_secret(secret: dict[str, Any]) -> None:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    try:
        client.CoreV1Api().create_namespaced_secret(secret["metadata"]["namespace"], secret)
    except client.ApiException as e:
        if e.status != 409:  # it exists: a relaunch keeps the token
            raise


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
    from moerl.launch.plan import SCHEDULERS
    from moerl.launch.plan import plan as make_plan

    parser = argparse.ArgumentParser(prog="moerl launch", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="moerl TOML config")
    parser.add_argument("--scheduler", required=True, choices=SCHEDULERS)
    parser.add_argument("--dryrun", action="store_true", help="print what would be submitted; submit nothing")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not (o.startswith("--") and "." in o.partition("=")[0])]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (overrides are --section.key=value)")
    try:
        plan = make_plan(load_config(args.config, overrides), args.scheduler)
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
        if args.dryrun:
            print("# moerl launch --dryrun: nothing was submitted; `kubectl apply -f -` takes these as they are")
            print(to_yaml([plan.secret, *jobs]), end="")
            return 0
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
