"""`moerl launch`: the [launch] config, the checks before submission, and the EKS manifests of the dry run."""

from __future__ import annotations

import base64
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from moerl.config import ConfigError, MoerlConfig, config_from_dict, dump_toml, load_config
from moerl.launch import cli
from moerl.launch.kubernetes import head_address, pod_templates, toleration
from moerl.launch.plan import job_base_name, plan

ROOT = Path(__file__).resolve().parents[2]
EKS = ROOT / "configs" / "eks-p5en.toml"
DEMO = ROOT / "configs" / "demo.toml"
K8S_VERSIONS = ["1.31.0", kubernetes_validate.latest_version()]


def eks(*overrides: str) -> MoerlConfig:
    return load_config(EKS, overrides)


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    return cli.kubernetes_manifests(plan(eks(), "kubernetes"))


def jobs(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Job"}


def pods(job: dict) -> list[dict]:
    return [t["template"]["spec"] for t in job["spec"]["tasks"]]


def env_of(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["containers"][0].get("env", [])}


# ------------------------------------------------------------------------------------- config
def test_eks_config_loads_and_round_trips() -> None:
    cfg = eks()
    assert (cfg.launch.trainer_nodes, cfg.launch.rollout_nodes, cfg.launch.instance_type) == (16, 32, "p5en.48xlarge")
    assert cfg.checkpoint.dir.startswith("s3://") and cfg.launch.zone
    assert load_config(None, []).launch == MoerlConfig().launch
    assert config_from_dict(tomllib.loads(dump_toml(cfg)), MoerlConfig) == cfg


@pytest.mark.parametrize("override, needle", [
    ("--launch.trainer_capacity=spot", "launch.trainer_capacity"),
    ("--launch.rollout_grace_s=60", "launch.rollout_grace_s"),
    ("--launch.rollout_min_nodes=40", "launch.rollout_min_nodes"),
    ("--launch.tolerations=['bad key!']", "launch.tolerations"),
    ("--launch.name=Not_A_Label", "launch.name"),
    ("--launch.hugepages_mib=5121", "launch.hugepages_mib"),
    ("--launch.gpus_per_node=-2", "launch.gpus_per_node"),
])
def test_launch_section_rejects(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        eks(override)


@pytest.mark.parametrize("overrides, needle", [
    (["--launch.gpus_per_node=16"], r"'launch.gpus_per_node' asks for 16 GPUs per node, but p5en.48xlarge has 8"),
    (["--launch.efa_per_node=32"], r"'launch.efa_per_node' asks for 32 EFA devices .* p5en.48xlarge has 16"),
    (["--launch.zone="], r"'launch.zone' is required"),
    (["--launch.image="], r"'launch.image' is required"),
    (["--launch.instance_type=p4d.24xlarge"], r"not a known instance type"),
    (["--launch.rollout_instance_type=g5.xlarge"], r"launch.rollout_instance_type"),
    (["--train.num_ranks=129", "--ep.size=1"], r"'train.num_ranks' x train.gpus_per_rank needs 129 GPUs"),
    (["--ep.size=48"], r"config key 'ep.size' must divide train.num_ranks \(128\), got 48"),
    (["--rollout.num_workers=257"], r"'rollout.num_workers' .* needs 257 GPUs"),
    (["--ray.address=10.0.0.1:6379"], r"'ray.address' must be empty"),
    (["--rollout.grace_s=115"], r"must exceed rollout.grace_s"),
])
def test_bad_input_fails_before_submission(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        plan(eks(*overrides), "kubernetes")


def test_spot_trainer_is_refused_before_submission() -> None:
    with pytest.raises(ConfigError, match="trainer_capacity.*on_demand.*spot capacity is for rollout only"):
        eks("--launch.trainer_capacity=spot")


def test_local_cwd_needs_no_image_or_zone() -> None:
    p = plan(load_config(DEMO, []), "local_cwd")
    assert [pl.app.roles[0].name for pl in p.apps] == ["trainer"] and p.apps[0].shape is None
    role = p.apps[0].app.roles[0]
    assert role.args[-1] == "train" and role.num_replicas == 1
    assert base64.b64decode(role.env["MOERL_CONFIG_B64"]).decode() == dump_toml(load_config(DEMO, []))
    with pytest.raises(ConfigError, match="unknown scheduler"):
        plan(load_config(DEMO, []), "slurm")


def test_job_name_from_run_name() -> None:
    assert job_base_name(load_config(DEMO, ["--run.name=My Run_2"])) == "my-run-2"
    assert job_base_name(load_config(DEMO, ["--run.name=2024"])) == "moerl-2024"
    assert job_base_name(eks()) == "qwen3-grpo"


def test_toleration_syntax() -> None:
    assert toleration("nvidia.com/gpu:NoSchedule") == {"key": "nvidia.com/gpu", "operator": "Exists",
                                                       "effect": "NoSchedule"}
    assert toleration("spot=true") == {"key": "spot", "operator": "Equal", "value": "true"}


# -------------------------------------------------------------------------------- manifests
def test_every_pod_template_is_valid_kubernetes(manifests: list[dict]) -> None:
    assert [d["kind"] for d in manifests] == ["Secret", "Job", "Job"]
    n = 0
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(manifests[0], version, strict=True)
        for job in manifests[1:]:
            for pod in pod_templates(job):
                kubernetes_validate.validate(pod, version, strict=True)
                n += 1
    assert n == 2 * (16 + 32)


def test_selectors_zone_and_capacity(manifests: list[dict]) -> None:
    js = jobs(manifests)
    for name, capacity, count in [("qwen3-grpo-trainer", "ON_DEMAND", 16), ("qwen3-grpo-rollout", "SPOT", 32)]:
        assert len(pods(js[name])) == count
        for pod in pods(js[name]):
            assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5en.48xlarge",
                                           "eks.amazonaws.com/capacityType": capacity,
                                           "topology.kubernetes.io/zone": "us-east-2b"}
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_resources_grace_and_env(manifests: list[dict]) -> None:
    js = jobs(manifests)
    for pod in pods(js["qwen3-grpo-trainer"]):
        res = pod["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == "8" and res["limits"]["vpc.amazonaws.com/efa"] == "16"
        assert res["limits"]["hugepages-2Mi"] == res["requests"]["hugepages-2Mi"] == "5120Mi"
        assert pod["terminationGracePeriodSeconds"] == 60
        env = env_of(pod)
        assert env["FI_PROVIDER"]["value"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"]["value"] == "1"
        assert "NCCL_PROTO" not in env and "NCCL_NVLS_ENABLE" not in env
        assert {"name": "pvc-fsx-claim", "mountPath": "/fsx"} in pod["containers"][0]["volumeMounts"]
    for pod in pods(js["qwen3-grpo-rollout"]):
        res = pod["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == "8" and "vpc.amazonaws.com/efa" not in res["limits"]
        assert pod["terminationGracePeriodSeconds"] >= 90
    for job in js.values():
        for pod in pods(job):
            env = env_of(pod)
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "qwen3-grpo-ray-token", "key": "token"}
            assert pod["serviceAccountName"] == "moerl"


def test_rollout_finds_the_head_and_jobs_restart_as_designed(manifests: list[dict]) -> None:
    js = jobs(manifests)
    trainer, rollout = js["qwen3-grpo-trainer"], js["qwen3-grpo-rollout"]
    head = head_address("qwen3-grpo-trainer", "moerl", 6379)
    assert head == "qwen3-grpo-trainer-trainer-0-0.qwen3-grpo-trainer.moerl.svc.cluster.local:6379"
    assert trainer["spec"]["tasks"][0]["name"] == "trainer-0"  # Volcano names the pod <job>-<task>-0
    for pod in pods(rollout):
        args = pod["containers"][0]["command"]
        assert args[args.index("--head") + 1] == head
    ranks = [p["containers"][0]["command"] for p in pods(trainer)]
    assert ranks[0][ranks[0].index("--head-env") + 1] == "TORCHX_RANK0_HOST"
    assert ranks[1][ranks[1].index("--head-env") + 1] == "VC_TRAINER_0_HOSTS"  # set by Volcano's svc plugin
    assert trainer["spec"]["minAvailable"] == 16 and trainer["spec"]["maxRetry"] == 3
    assert {"event": "TaskCompleted", "action": "CompleteJob"} in trainer["spec"]["tasks"][0]["policies"]
    assert all({"event": "PodFailed", "action": "RestartJob"} in t["policies"] for t in trainer["spec"]["tasks"])
    assert rollout["spec"]["minAvailable"] == 8
    assert [t["minAvailable"] for t in rollout["spec"]["tasks"]] == [1] * 8 + [0] * 24
    assert all(t["policies"] == [{"event": "PodEvicted", "action": "RestartTask"},
                                 {"event": "PodFailed", "action": "RestartTask"}] for t in rollout["spec"]["tasks"])
    for job in (trainer, rollout):
        assert "--disable-network-policy" in job["spec"]["plugins"]["svc"]
        assert job["metadata"]["namespace"] == "moerl" == manifests[0]["metadata"]["namespace"]


def test_dryrun_prints_yaml_and_submits_nothing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from torchx.runner.api import Runner

    def refuse(*_a, **_k):
        raise AssertionError("the dry run submitted something")

    monkeypatch.setattr(Runner, "schedule", refuse)
    monkeypatch.setattr(cli, "_create_secret", refuse)
    assert cli.main([str(EKS), "--scheduler", "kubernetes", "--dryrun", "--launch.rollout_nodes=2",
                     "--launch.rollout_min_nodes=1", "--rollout.num_workers=16"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["kind"] for d in docs] == ["Secret", "Job", "Job"]
    assert len(docs[2]["spec"]["tasks"]) == 2


def test_cli_reports_bad_input(capsys: pytest.CaptureFixture) -> None:
    assert cli.main([str(EKS), "--scheduler", "kubernetes", "--dryrun", "--launch.zone="]) == 2
    assert "launch.zone" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([str(EKS), "--scheduler", "kubernetes", "stray"])
