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
    ("--launch.secret_env.AWS_SECRET_ACCESS_KEY=aws-creds", "launch.secret_env"),  # no key
    ("--launch.secret_env.AWS_SECRET_ACCESS_KEY=AWS_Creds/key", "launch.secret_env"),  # not a DNS name
    ("--launch.secret_env.AWS_SECRET_ACCESS_KEY=aws-creds/", "launch.secret_env"),
    ("--launch.secret_env.AWS_SECRET_ACCESS_KEY=aws-creds/a/b", "launch.secret_env"),
    ("--launch.secret_env.1BAD=aws-creds/key", "launch.secret_env"),
    ("--launch.secret_env.RAY_AUTH_TOKEN=mine/token", "launch.secret_env"),
    ("--launch.secret_env.AWS_REGION=aws-creds/region", "launch.secret_env"),  # also in launch.env
    ("--launch.env.HF_TOKEN=hf_abc", "launch.env"),  # a credential as plain env
    ("--launch.env.AWS_SECRET_ACCESS_KEY=abc", "launch.env"),
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
    (["--launch.efa_per_node=16", "--launch.rollout_instance_type=p6-b200.48xlarge"],
     r"'launch.efa_per_node' asks for 16 EFA devices .* p6-b200.48xlarge has 8"),
    (["--train.num_ranks=129", "--ep.size=1"], r"'train.num_ranks' x train.gpus_per_rank needs 129 GPUs"),
    (["--ep.size=48"], r"config key 'ep.size' must divide train.num_ranks \(128\), got 48"),
    (["--rollout.num_workers=257"], r"'rollout.num_workers' .* needs 257 GPUs"),
    (["--rollout.ep_size=16", "--rollout.gpus_per_worker=16", "--rollout.num_workers=16", "--rollout.min_workers=8"],
     r"'rollout.ep_size' \(16 GPUs per rollout engine\) exceeds the 8 GPUs of a rollout node"),
    (["--rollout.ep_size=8", "--rollout.gpus_per_worker=8"], r"'rollout.num_workers' .* needs 2048 GPUs"),
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
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert pod["terminationGracePeriodSeconds"] >= 90
    for job in js.values():
        for pod in pods(job):
            env = env_of(pod)
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "qwen3-grpo-ray-token", "key": "token"}
            assert pod["serviceAccountName"] == "moerl"


EFA_KEYS = ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "NCCL_DEBUG")  # the EFA env and launch.env's NCCL setting


def efa_of(pod: dict) -> tuple[str | None, str | None, dict]:
    """(EFA devices, hugepages-2Mi, the EFA/NCCL env) a pod asks for; extended resources are limits only."""
    res, env = pod["containers"][0]["resources"], env_of(pod)
    pages = res["limits"].get("hugepages-2Mi")
    assert pages == res["requests"].get("hugepages-2Mi")  # hugepages: requests == limits
    return res["limits"].get("vpc.amazonaws.com/efa"), pages, {k: env[k]["value"] for k in EFA_KEYS if k in env}


def test_rollout_pods_request_efa_as_the_trainer_pods_do(manifests: list[dict]) -> None:
    # rollout pods run on nodes other than the trainer's: weights cross nodes, so they get EFA like the trainer
    js = jobs(manifests)
    trainer, rollout = pods(js["qwen3-grpo-trainer"]), pods(js["qwen3-grpo-rollout"])
    want = ("16", "5120Mi", {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_DEBUG": "WARN"})
    assert len(rollout) == 32 and all(efa_of(p) == want for p in trainer + rollout)
    for pod in rollout:
        assert "NCCL_PROTO" not in env_of(pod) and "NCCL_NVLS_ENABLE" not in env_of(pod)
        assert {"key": "vpc.amazonaws.com/efa", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


@pytest.mark.parametrize("overrides, trainer_efa, rollout_efa", [
    (["--launch.efa_per_node=0"], None, None),  # EFA off: no devices, hugepages or EFA env anywhere
    (["--launch.efa_per_node=4"], "4", "4"),
    (["--launch.rollout_instance_type=p6-b200.48xlarge"], "16", "8"),  # -1: all of each node's type
])
def test_rollout_efa_follows_launch_efa_per_node(overrides: list[str], trainer_efa: str | None,
                                                 rollout_efa: str | None) -> None:
    js = jobs(cli.kubernetes_manifests(plan(eks(*overrides), "kubernetes")))
    for job, efa in (("qwen3-grpo-trainer", trainer_efa), ("qwen3-grpo-rollout", rollout_efa)):
        for pod in pods(js[job]):
            devices, pages, env = efa_of(pod)
            assert devices == efa and pages == ("5120Mi" if efa else None)
            assert env == ({"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_DEBUG": "WARN"} if efa
                           else {"NCCL_DEBUG": "WARN"})
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(pod_templates(js[job])[0], version, strict=True)


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


def test_secret_env_error_is_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        eks("--launch.secret_env.AWS_SECRET_ACCESS_KEY=no-slash")
    assert "\n" not in str(e.value) and str(e.value).startswith("config key 'launch.secret_env'")
    assert "'AWS_SECRET_ACCESS_KEY'" in str(e.value) and "secret-name/key" in str(e.value)
    assert eks("--launch.env.TOKENIZERS_PARALLELISM=false").launch.env["TOKENIZERS_PARALLELISM"] == "false"


SECRET_ENV = ["--launch.secret_env.AWS_ACCESS_KEY_ID=aws-creds/id",
              "--launch.secret_env.AWS_SECRET_ACCESS_KEY=aws-creds/secret", "--launch.secret_env.HF_TOKEN=hf/token"]


def test_secret_env_renders_secret_key_refs_on_every_pod() -> None:
    docs = cli.kubernetes_manifests(plan(eks(*SECRET_ENV), "kubernetes"))
    js = jobs(docs)
    assert set(js) == {"qwen3-grpo-trainer", "qwen3-grpo-rollout"}
    for job in js.values():
        for pod in pods(job):
            env = env_of(pod)
            assert env["AWS_ACCESS_KEY_ID"] == {"name": "AWS_ACCESS_KEY_ID",
                                                "valueFrom": {"secretKeyRef": {"name": "aws-creds", "key": "id"}}}
            assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "aws-creds", "key": "secret"}
            assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
            assert all("value" not in env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"))
    for version in K8S_VERSIONS:
        for job in js.values():
            kubernetes_validate.validate(pod_templates(job)[0], version, strict=True)


def test_pods_config_has_no_launch_env_or_secret_env() -> None:
    cfg = eks(*SECRET_ENV, "--launch.env.MY_VALUE=plain-sentinel-4711")
    p = plan(cfg, "kubernetes")
    shipped = [role.env["MOERL_CONFIG_B64"] for pl in p.apps for role in pl.app.roles if "MOERL_CONFIG_B64" in role.env]
    assert shipped
    local = plan(load_config(DEMO, ["--launch.env.MY_VALUE=plain-sentinel-4711", *SECRET_ENV]), "local_cwd")
    shipped.append(local.apps[0].app.roles[0].env["MOERL_CONFIG_B64"])
    for b64 in shipped:
        text = base64.b64decode(b64).decode()
        for needle in ("plain-sentinel-4711", "MY_VALUE", "AWS_REGION", "aws-creds", "HF_TOKEN"):
            assert needle not in text
        got = config_from_dict(tomllib.loads(text), MoerlConfig)
        assert got.launch.env == {} and got.launch.secret_env == {}
    got = config_from_dict(tomllib.loads(base64.b64decode(shipped[0]).decode()), MoerlConfig)
    assert got.train == cfg.train and got.launch.trainer_nodes == cfg.launch.trainer_nodes
    # the plain value is in the pods' env (where the nodes need it), and nowhere else in the manifests
    docs = cli.kubernetes_manifests(p)
    assert str(docs).count("plain-sentinel-4711") == len(pods(jobs(docs)["qwen3-grpo-trainer"])) + len(
        pods(jobs(docs)["qwen3-grpo-rollout"]))


def test_dryrun_never_prints_the_token(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from moerl.launch import kubernetes

    monkeypatch.setattr(kubernetes.secrets, "token_hex", lambda n=32: "f00d" * 16)
    assert cli.main([str(EKS), "--scheduler", "kubernetes", "--dryrun", *SECRET_ENV]) == 0
    out = capsys.readouterr()
    assert "f00d" not in out.out + out.err and "stringData" not in out.out
    docs = [d for d in yaml.safe_load_all(out.out) if d]
    assert [d["kind"] for d in docs] == ["Job", "Job"]
    assert ('# kubectl create secret generic qwen3-grpo-ray-token -n moerl '
            '--from-literal=token="$(openssl rand -hex 32)"') in out.out.replace("#   ", "# ")
    assert "AWS_SECRET_ACCESS_KEY <- secret 'aws-creds', key 'secret'" in out.out


def test_real_launch_creates_the_token_secret_without_printing_it(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    from torchx.runner.api import Runner

    from moerl.launch import kubernetes

    class Api:
        created: list[dict] = []

        def create_namespaced_secret(self, namespace: str, body: dict) -> None:
            self.created.append(body)

        def read_namespaced_secret(self, name: str, namespace: str):
            return type("S", (), {"data": {"id": "eA==", "secret": "eA==", "token": "eA=="}})()

    monkeypatch.setattr(kubernetes.secrets, "token_hex", lambda n=32: "f00d" * 16)
    monkeypatch.setattr(cli, "_core_api", Api)
    monkeypatch.setattr(Runner, "schedule", lambda self, info: f"kubernetes://moerl/{info.request.resource['metadata']['name']}")
    assert cli.main([str(EKS), "--scheduler", "kubernetes", *SECRET_ENV]) == 0
    out = capsys.readouterr()
    assert [s["stringData"]["token"] for s in Api.created] == ["f00d" * 16]
    assert "f00d" not in out.out + out.err and out.out.count("submitted") == 2


def test_real_launch_refuses_a_missing_secret(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from kubernetes.client import ApiException
    from torchx.runner.api import Runner

    class Api:
        def read_namespaced_secret(self, name: str, namespace: str):
            if name == "hf":
                raise ApiException(status=404, reason="Not Found")
            return type("S", (), {"data": {"id": "eA=="}})()

        def create_namespaced_secret(self, namespace: str, body: dict) -> None:
            raise AssertionError("created the token Secret though the launch is refused")

    def refuse(*_a, **_k):
        raise AssertionError("submitted")

    monkeypatch.setattr(cli, "_core_api", Api)
    monkeypatch.setattr(Runner, "schedule", refuse)
    assert cli.main([str(EKS), "--scheduler", "kubernetes", *SECRET_ENV]) == 2
    err = capsys.readouterr().err
    assert "Secret 'hf' in namespace moerl does not exist" in err and "has no key 'secret'" in err


def test_dryrun_prints_yaml_and_submits_nothing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from torchx.runner.api import Runner

    def refuse(*_a, **_k):
        raise AssertionError("the dry run submitted something")

    monkeypatch.setattr(Runner, "schedule", refuse)
    monkeypatch.setattr(cli, "_create_secret", refuse)
    assert cli.main([str(EKS), "--scheduler", "kubernetes", "--dryrun", "--launch.rollout_nodes=2",
                     "--launch.rollout_min_nodes=1", "--rollout.num_workers=16", "--rollout.min_workers=8"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["kind"] for d in docs] == ["Job", "Job"]  # the token Secret is a comment: see the next test
    assert len(docs[1]["spec"]["tasks"]) == 2
    assert all(efa_of(t["template"]["spec"])[:2] == ("16", "5120Mi") for d in docs for t in d["spec"]["tasks"])


def test_dryrun_says_how_the_rollout_fleet_grows(capsys: pytest.CaptureFixture) -> None:
    """The EKS config starts on 8 spot nodes with rollout.min_workers = 64 up and grows to 32 (issue 38 item 1):
    said in the dry run's header and on the rollout job (an annotation), beside Volcano's minAvailable."""
    assert cli.main([str(EKS), "--scheduler", "kubernetes", "--dryrun"]) == 0
    out = capsys.readouterr().out
    growth = ("rollout fleet: leases start once rollout.min_workers=64 of rollout.num_workers=256 workers are up; the "
              "rollout job starts with launch.rollout_min_nodes=8 spot nodes (64 workers at 8 per node) and grows to "
              "launch.rollout_nodes=32 as capacity comes; the other 192 workers wait for capacity, without a "
              "deadline, and join as their nodes come")
    assert f"# {growth}\n" in out
    rollout = jobs([d for d in yaml.safe_load_all(out) if d])["qwen3-grpo-rollout"]
    assert rollout["metadata"]["annotations"][cli.FLEET_ANNOTATION] == growth
    assert rollout["spec"]["minAvailable"] == 8 and len(rollout["spec"]["tasks"]) == 32
    short = cli.fleet_growth(eks("--rollout.min_workers=65"))
    assert short.endswith("warning: the first 8 nodes hold 64 workers, fewer than rollout.min_workers: the run stops "
                          "unless more nodes come within rollout.start_timeout_s=600 s")


def test_cli_reports_bad_input(capsys: pytest.CaptureFixture) -> None:
    assert cli.main([str(EKS), "--scheduler", "kubernetes", "--dryrun", "--launch.zone="]) == 2
    assert "launch.zone" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([str(EKS), "--scheduler", "kubernetes", "stray"])
