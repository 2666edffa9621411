"""The typed config system: TOML files, dotted CLI overrides, error messages, round-trip, genericity."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from moerl.config import (
    MOVED_KEYS,
    ConfigError,
    MoerlConfig,
    config_from_dict,
    config_to_dict,
    dump_toml,
    load_config,
    require,
)
from moerl.train.config import LossConfig, OptimConfig

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"


def write(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------ a tiny ad-hoc schema (genericity)
@dataclass
class Inner:
    ratio: float = 0.5
    tags: list[str] = field(default_factory=list)
    shape: tuple[int, ...] = (2, 3)
    weights: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        require(self.ratio <= 1, "ratio", "must be <= 1")


@dataclass
class Outer:
    label: str = "x"
    limit: int | None = None
    color: Literal["red", "blue"] = "red"
    inner: Inner = field(default_factory=Inner)
    env: dict[str, str] = field(default_factory=dict)
    extra: Inner | None = None


# ------------------------------------------------------------------------------------ loading
def test_demo_toml_loads_with_its_values():
    cfg = load_config(DEMO)
    assert isinstance(cfg, MoerlConfig)
    assert cfg.train.steps == 600 and cfg.train.sft_steps == 40 and cfg.train.mode == "async"
    assert cfg.rollout.num_workers == 2 and cfg.rollout.group_size == 8
    assert cfg.task.name == "moerl.tasks.arithmetic:ArithmeticTask" and cfg.task.options == {"max_operand": 9, "ops": "+"}
    assert cfg.run.device == "cpu" and cfg.ray.num_cpus == 2


def test_no_path_means_defaults_and_checkpoint_dir_falls_back_to_run_dir():
    cfg = load_config(None)
    assert cfg == MoerlConfig()
    assert cfg.run.device == "auto" and cfg.model.routing_replay is True and cfg.train.optim.lr == 1e-4
    assert cfg.checkpoint_dir() == "runs/demo/checkpoints"
    assert load_config(None, ["--checkpoint.dir=/tmp/ck"]).checkpoint_dir() == "/tmp/ck"


def test_file_sets_only_given_keys(tmp_path):
    cfg = load_config(write(tmp_path, "[train]\nsteps = 7\n[model]\nrouter_aux_loss_coef = 1.25\n"))
    assert cfg.train.steps == 7 and cfg.model.router_aux_loss_coef == 1.25
    assert cfg.train.optim.lr == 1e-4 and cfg.rollout.num_workers == 2


# ---------------------------------------------------------------------------------- overrides
def test_overrides_of_each_scalar_type_win_over_the_file():
    cfg = load_config(DEMO, [
        "--train.steps=5",  # int
        "train.optim.lr=3e-5",  # float, without the leading dashes
        "--rollout.temperature=2",  # int accepted for float
        "--model.routing_replay=false",  # bool
        "--run.device=cpu",  # Literal, bare word
        "--model.dtype=\"bfloat16\"",  # Literal, quoted TOML string
        "--run.name=2024",  # a str field keeps "2024" as a string
        "--checkpoint.dir=s3://bucket/p",  # not a TOML literal: a plain string
        "--ray.address=",  # empty string
    ])
    assert cfg.train.steps == 5
    assert cfg.train.optim.lr == 3e-5
    assert cfg.rollout.temperature == 2.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.model.routing_replay is False
    assert cfg.run.device == "cpu" and cfg.model.dtype == "bfloat16"
    assert cfg.run.name == "2024"
    assert cfg.checkpoint.dir == "s3://bucket/p"
    assert cfg.ray.address == ""


def test_bare_flag_sets_bool_true_and_later_override_wins():
    assert load_config(DEMO, ["--run.deterministic"]).run.deterministic is True
    assert load_config(DEMO, ["--train.steps=3", "--train.steps=4"]).train.steps == 4
    with pytest.raises(ConfigError, match=r"'train.steps' needs a value"):
        load_config(DEMO, ["--train.steps"])


def test_overrides_on_generic_schema_optional_list_tuple_dict(tmp_path):
    cfg = load_config(None, [
        "--limit=12",  # Optional[int]
        "--inner.tags=[\"a\", \"b\"]",  # list[str]
        "--inner.shape=[4, 5, 6]",  # tuple[int, ...]
        "--inner.weights.foo=0.25",  # dict[str, float], one entry
        "--env.HF_HOME=/data/hf",  # dict[str, str], one entry
        "--extra.ratio=0.75",  # Optional nested section that was None
    ], cls=Outer)
    assert cfg.limit == 12
    assert cfg.inner.tags == ["a", "b"]
    assert cfg.inner.shape == (4, 5, 6)
    assert cfg.inner.weights == {"foo": 0.25}
    assert cfg.env == {"HF_HOME": "/data/hf"}
    assert cfg.extra == Inner(ratio=0.75)
    path = write(tmp_path, "limit = 3\n")
    assert load_config(path, ["--limit=none"], cls=Outer).limit is None
    with pytest.raises(ConfigError, match=r"'inner.shape\[1\]' expects int, got 'x' \(str\)"):
        load_config(None, ["--inner.shape=[1, \"x\"]"], cls=Outer)


# ----------------------------------------------------------------------------------- errors
def test_unknown_key_in_file_names_key_file_and_closest(tmp_path):
    path = write(tmp_path, "[train]\nstpes = 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"unknown config key 'train.stpes' (in {path}); did you mean 'train.steps'?"


def test_unknown_key_on_command_line_names_closest():
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["--rollout.num_wrokers=3"])
    assert "unknown config key 'rollout.num_wrokers' (on the command line)" in str(err.value)
    assert "did you mean 'rollout.num_workers'?" in str(err.value)
    with pytest.raises(ConfigError, match=r"'train.num_workers'.*did you mean 'rollout.num_workers'"):
        load_config(DEMO, ["--train.num_workers=3"])  # right name, wrong section
    with pytest.raises(ConfigError, match=r"unknown config key 'train.steps.x'"):
        load_config(DEMO, ["--train.steps.x=1"])  # below a scalar


def test_unknown_section_in_file_and_on_command_line(tmp_path):
    path = write(tmp_path, "[trian]\nsteps = 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"unknown config section 'trian' (in {path}); did you mean 'train'?"
    with pytest.raises(ConfigError, match=r"unknown config key 'trian.steps' .*did you mean 'train.steps'"):
        load_config(None, ["--trian.steps=3"])


def test_wrong_type_names_key_expected_type_and_value(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["--train.steps=2x"])
    assert str(err.value) == "config key 'train.steps' expects int, got '2x' (str) from the command line"
    path = write(tmp_path, "[rollout]\ntop_p = \"high\"\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"config key 'rollout.top_p' expects float, got 'high' (str) from {path}"


def test_bool_rejected_for_int_and_float_but_int_accepted_for_float():
    with pytest.raises(ConfigError, match=r"'train.steps' expects int, got True \(bool\)"):
        load_config(None, ["--train.steps=true"])
    with pytest.raises(ConfigError, match=r"'train.optim.lr' expects float, got False \(bool\)"):
        config_from_dict({"train": {"optim": {"lr": False}}}, MoerlConfig)
    with pytest.raises(ConfigError, match=r"'train.steps' expects int, got 2.0 \(float\)"):
        config_from_dict({"train": {"steps": 2.0}}, MoerlConfig)
    cfg = config_from_dict({"train": {"optim": {"lr": 1}}, "model": {"router_aux_loss_coef": 2}}, MoerlConfig)
    assert cfg.train.optim.lr == 1.0 and type(cfg.train.optim.lr) is float and type(cfg.model.router_aux_loss_coef) is float


def test_literal_error_lists_choices():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--run.device=gpu"])
    assert "config key 'run.device' expects one of 'auto', 'cpu', 'cuda', got 'gpu' (str)" in str(err.value)
    with pytest.raises(ConfigError, match=r"'train.mode' expects one of 'async', 'sync'"):
        config_from_dict({"train": {"mode": "Async"}}, MoerlConfig)


def test_validate_errors_name_the_key():
    cases = {
        "--rollout.top_p=1.5": "config key 'rollout.top_p' must be in (0, 1], got 1.5",
        "--rollout.top_p=0": "config key 'rollout.top_p' must be in (0, 1], got 0.0",
        "--rollout.num_workers=0": "config key 'rollout.num_workers' must be >= 1, got 0",
        "--rollout.gpu_memory_fraction=0": "config key 'rollout.gpu_memory_fraction' must be in (0, 1], got 0.0",
        "--rollout.kv_cache_tokens=-1": "config key 'rollout.kv_cache_tokens' must be >= 0 (0 = from memory), got -1",
        "--ep.size=0": "config key 'ep.size' must be >= 1, got 0",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(DEMO, [override])
        assert str(err.value) == message
    for value in ("-1", "1.25"):  # refused, not ignored: the engine would not drop what the trainer drops
        with pytest.raises(ConfigError, match=r"^config key 'model.capacity_factor' must be 0 \(dropless\): drops "
                                              r"depend on the batch .* not replayed.*, got"):
            load_config(DEMO, [f"--model.capacity_factor={value}"])
    with pytest.raises(ConfigError, match=r"config key 'inner.ratio' must be <= 1, got 2.0"):
        config_from_dict({"inner": {"ratio": 2}}, Outer)  # validate() of a generic nested section
    assert config_from_dict({"inner": {"ratio": 2}}, Outer, validate=False).inner.ratio == 2.0


def test_missing_file_and_malformed_toml_name_the_file(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as err:
        load_config(missing)
    assert str(err.value) == f"config file not found: {missing}"
    bad = write(tmp_path, "[train]\nsteps = = 3\n", "bad.toml")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert f"invalid TOML in config file {bad}" in str(err.value)
    assert "line 2" in str(err.value)  # the parser's position


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_config(None, ["--train.nope=1"])


# ------------------------------------------------------------------------------ round-trip
def test_dump_load_round_trip_of_changed_schema_config(tmp_path):
    cfg = load_config(DEMO, ["--train.optim.lr=3.3e-7", "--run.name=a \"quoted\" \\ name\n", "--run.deterministic",
                             "--checkpoint.dir=s3://b/p", "--model.dtype=float16", "--rollout.top_p=0.1"])
    text = dump_toml(cfg)
    assert "[train]\nsteps = 600\n" in text and 'dir = "s3://b/p"' in text
    assert load_config(write(tmp_path, text)) == cfg


def test_dump_load_round_trip_of_generic_schema(tmp_path):
    cfg = Outer(label="tab\there", limit=None, color="blue",
                inner=Inner(ratio=0.1, tags=["x", "é"], shape=(1,), weights={"a.b": 1.5, "plain": -2.0}),
                env={"K": "v"}, extra=Inner(tags=[]))
    text = dump_toml(cfg)
    assert "limit" not in text  # None is omitted
    assert load_config(write(tmp_path, text), cls=Outer) == cfg
    assert config_to_dict(cfg)["inner"]["shape"] == [1]
    assert config_from_dict(config_to_dict(cfg), Outer) == cfg


def test_config_to_dict_is_plain_nested_dicts():
    d = config_to_dict(MoerlConfig())
    assert list(d) == [f.name for f in dataclasses.fields(MoerlConfig)]
    assert d["train"]["steps"] == 50 and d["model"]["dispatcher"] == "auto"
    assert all(isinstance(section, dict) for section in d.values())


def test_importing_the_config_does_not_import_torch():
    code = "import moerl.config, moerl.train.config, sys; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------- train.loss and train.optim
# a valid, non-default value for every field of the two sections (a new field must be added here)
NON_DEFAULT = {
    "loss": {"trust_region": "none", "clip_eps_low": 0.1, "clip_eps_high": 0.3, "clip_ratio_c": 5.0,
             "is_correction": "mask", "is_cap": 3.0, "is_mask_low": 0.25, "m2_threshold": 0.1, "ess_lr_scaling": True,
             "kl_coef": 0.05, "aggregation": "seq-mean-token-sum", "normalize_adv_std": False, "entropy_coef": 0.01},
    "optim": {"lr": 3e-5, "weight_decay": 0.1, "betas": (0.8, 0.99), "grad_clip": 0.0, "warmup_steps": 10},
}
SECTIONS = {"loss": LossConfig, "optim": OptimConfig}
REFUSED = {("loss", "kl_coef")}  # valid for the section, refused by the whole config (see the test below)


def toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(map(toml_literal, value)) + "]"
    return repr(value)


def test_train_defaults_are_unchanged():
    train = MoerlConfig().train
    assert train.optim == OptimConfig() and train.loss == LossConfig()
    assert (train.optim.lr, train.optim.grad_clip) == (1e-4, 1.0)
    assert (train.loss.trust_region, train.loss.clip_eps_low, train.loss.clip_eps_high, train.loss.clip_ratio_c,
            train.loss.is_correction, train.loss.is_cap, train.loss.kl_coef, train.loss.normalize_adv_std,
            train.minibatches) == ("behaviour", 0.2, 0.28, 3.0, "none", 2.0, 0.0, True, 1)


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_loss_and_optim_field_is_settable_from_file_and_command_line(tmp_path, section):
    cls, values = SECTIONS[section], NON_DEFAULT[section]
    assert set(values) == {f.name for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        value = values[f.name]
        assert value != getattr(cls(), f.name), f.name  # really not the default
        if (section, f.name) in REFUSED:
            continue
        expected = dataclasses.replace(cls(), **{f.name: value})
        path = write(tmp_path, f"[train.{section}]\n{f.name} = {toml_literal(value)}\n")
        from_file = getattr(load_config(path).train, section)
        from_cli = getattr(load_config(None, [f"--train.{section}.{f.name}={toml_literal(value)}"]).train, section)
        for got in (from_file, from_cli):
            assert got == expected, f.name
            assert type(getattr(got, f.name)) is type(value), f.name
    settable = {k: v for k, v in values.items() if (section, k) not in REFUSED}
    everything = load_config(None, [f"--train.{section}.{k}={toml_literal(v)}" for k, v in settable.items()])
    assert getattr(everything.train, section) == cls(**settable)


def test_the_proximal_trust_region_needs_several_updates_per_step():
    with pytest.raises(ConfigError, match=r"'train.minibatches' must be >= 2 with train.loss.trust_region = 'proximal'"):
        load_config(None, ["--train.loss.trust_region=proximal"])
    assert load_config(None, ["--train.loss.trust_region=proximal", "--train.minibatches=2"]).train.minibatches == 2


def test_forced_staleness_must_pass_the_staleness_gate_in_async_mode():
    with pytest.raises(ConfigError, match=r"'train.forced_staleness' must be <= train.max_staleness \(1\)"):
        load_config(None, ["--train.forced_staleness=2"])
    with pytest.raises(ConfigError, match=r"'train.forced_staleness' needs train.mode = 'async'"):
        load_config(None, ["--train.forced_staleness=1", "--train.mode=sync"])
    assert load_config(None, ["--train.forced_staleness=4", "--train.max_staleness=4"]).train.forced_staleness == 4


def test_kl_coef_is_refused_until_the_trainer_keeps_a_reference_policy():
    with pytest.raises(ConfigError, match=r"'train.loss.kl_coef' must be 0: the trainer keeps no reference policy"):
        load_config(None, ["--train.loss.kl_coef=0.05"])


def test_betas_is_a_pair_of_floats(tmp_path):
    betas = load_config(None, ["--train.optim.betas=[0.9, 0.99]"]).train.optim.betas
    assert betas == (0.9, 0.99) and type(betas) is tuple and all(type(b) is float for b in betas)
    assert load_config(None, ["--train.optim.betas=[0, 0.5]"]).train.optim.betas == (0.0, 0.5)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--train.optim.betas=[0.9, 0.99, 0.999]"])
    assert str(err.value) == ("config key 'train.optim.betas' expects exactly 2 items (tuple[float, float]), "
                              "got 3 from the command line")
    path = write(tmp_path, "[train.optim]\nbetas = [0.9]\n")
    with pytest.raises(ConfigError, match=r"'train.optim.betas' expects exactly 2 items .*got 1 from "):
        load_config(path)
    with pytest.raises(ConfigError, match=r"'train.optim.betas\[1\]' expects float, got 'x' \(str\)"):
        load_config(None, ['--train.optim.betas=[0.9, "x"]'])


@pytest.mark.parametrize("old,new", sorted(MOVED_KEYS.items()))
def test_old_flat_train_keys_name_their_new_place(tmp_path, old, new):
    assert old.startswith("train.") and new.startswith(("train.loss.", "train.optim."))
    assert new.rsplit(".", 1)[1] in {f.name for f in dataclasses.fields(SECTIONS[new.split(".")[1]])}
    path = write(tmp_path, f"[train]\n{old.split('.', 1)[1]} = 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"config key {old!r} has moved to {new!r} (in {path})"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--{old}=1"])
    assert str(err.value) == f"config key {old!r} has moved to {new!r} (on the command line)"
    with pytest.raises(ConfigError, match=f"has moved to {new!r}"):
        load_config(None, [f"--{old.replace('_', '-')}=1"])  # dashed spelling


def test_loss_and_optim_checks_name_the_full_key(tmp_path):
    cases = {
        "--train.optim.lr=0": "config key 'train.optim.lr' must be a finite number > 0, got 0.0",
        "--train.optim.lr=inf": "config key 'train.optim.lr' must be a finite number > 0, got inf",
        "--train.optim.weight_decay=-0.1": "config key 'train.optim.weight_decay' must be >= 0, got -0.1",
        "--train.optim.betas=[0.9, 1.0]":
            "config key 'train.optim.betas' must be two numbers, each in [0, 1), got (0.9, 1.0)",
        "--train.optim.grad_clip=-1": "config key 'train.optim.grad_clip' must be >= 0 (0 = off), got -1.0",
        "--train.optim.warmup_steps=-1": "config key 'train.optim.warmup_steps' must be an integer >= 0, got -1",
        "--train.loss.is_cap=0.5":
            "config key 'train.loss.is_cap' must be >= 1 (on-policy weight 1 must pass), got 0.5",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert str(err.value) == message
    path = write(tmp_path, "[train.optim]\nlr = 0\n")
    with pytest.raises(ConfigError, match=r"^config key 'train.optim.lr' must be a finite number > 0, got 0.0$"):
        load_config(path)
    path = write(tmp_path, '[train.loss]\naggregation = "bogus"\n')
    with pytest.raises(ConfigError, match=r"^config key 'train.loss.aggregation' expects one of 'token-mean', "):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^config key 'train.loss.aggregation' expects one of .*'bogus'"):
        load_config(None, ["--train.loss.aggregation=bogus"])


def test_dump_load_round_trip_of_non_default_loss_and_optim(tmp_path):
    settable = {section: {k: v for k, v in values.items() if (section, k) not in REFUSED}
                for section, values in NON_DEFAULT.items()}
    overrides = [f"--train.{section}.{k}={toml_literal(v)}" for section, values in settable.items()
                 for k, v in values.items()]
    cfg = load_config(DEMO, overrides)
    assert cfg.train.loss == LossConfig(**settable["loss"])
    assert cfg.train.optim == OptimConfig(**settable["optim"])
    text = dump_toml(cfg)
    assert "[train.optim]\n" in text and "betas = [0.8, 0.99]" in text
    assert load_config(write(tmp_path, text)) == cfg


def test_inflight_groups_follow_the_engine_batch_unless_set():
    cfg = load_config(None, ["--rollout.max_batch_size=256", "--rollout.group_size=16"])
    assert cfg.rollout.max_inflight_groups == 0 and cfg.rollout.inflight_groups() == 32
    assert load_config(None, ["--rollout.max_batch_size=5", "--rollout.group_size=8"]).rollout.inflight_groups() == 2
    assert load_config(None, ["--rollout.max_inflight_groups=3"]).rollout.inflight_groups() == 3
    with pytest.raises(ConfigError, match="'rollout.max_inflight_groups' must be >= 0"):
        load_config(None, ["--rollout.max_inflight_groups=-1"])


# ------------------------------------------------------------------------------------------ moerl config / --version
def test_moerl_config_refuses_a_missing_data_file_or_model(tmp_path, capsys) -> None:
    """`moerl config` printed the config and exited 0 for a data file or a model that is not there (issue 27)."""
    from moerl.cli import main as cli

    demo = str(Path(__file__).resolve().parents[2] / "configs" / "demo.toml")
    missing = tmp_path / "none.jsonl"
    assert cli(["config", demo, "--task.name=moerl.tasks.dataset:DatasetTask", f'--task.options={{path="{missing}"}}']) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "none.jsonl" in err[0] and "not found" in err[0], err
    assert captured.out == ""
    assert cli(["config", demo, f"--model.path={tmp_path / 'no-model'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: model.path '{tmp_path / 'no-model'}' does not exist (a Hugging Face checkpoint directory: "
                   "config.json and *.safetensors; empty = a random model of model.preset)"]
    assert cli(["config", demo]) == 0 and "[train]" in capsys.readouterr().out


def test_moerl_version(capsys) -> None:
    from importlib.metadata import version

    from moerl.cli import main as cli

    assert cli(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"moerl {version('moerl')}"


def test_pyproject_license_is_an_spdx_expression() -> None:
    """A `license = { text = ... }` table is deprecated (setuptools warns at every install, an error from 2027):
    an SPDX string, which needs setuptools >= 77 to build."""
    import re
    import tomllib

    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert tuple(map(int, re.search(r">=\s*([\d.]+)", setuptools).group(1).split("."))) >= (77,)


@pytest.mark.parametrize("overlap,flag", [("on", "true"), ("off", "false"), ("auto", "true")])
def test_rollout_engine_keys_reach_the_engine_config(overlap, flag):
    """rollout.overlap_decode and prefix_caching are accepted and arrive in the worker's EngineConfig."""
    from moerl.run import _specs, model_architecture
    from moerl.tasks.base import load_task

    cfg = load_config(DEMO, [f"--rollout.overlap_decode={overlap}", f"--rollout.prefix_caching={flag}"])
    task = load_task(cfg.task.name, dict(cfg.task.options), seed=0)
    worker, _ = _specs(cfg, model_architecture(cfg, task), task)
    assert worker.engine.overlap_decode is {"on": True, "off": False, "auto": None}[overlap]
    assert worker.engine.prefix_caching is (flag == "true")


def test_a_config_with_a_utf8_byte_order_mark_loads(tmp_path):
    """Windows editors save UTF-8 with a BOM: it read as "Invalid statement" (issue 37 item 13)."""
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + DEMO.read_bytes())
    assert load_config(path) == load_config(DEMO)


@pytest.mark.parametrize("url", ["ftp://host/ckpts", "gs://bucket/x", "http://example.com/c"])
def test_a_checkpoint_dir_of_a_scheme_moerl_cannot_store_through_is_refused(url):
    """`ftp://...` reached fsspec and ended in a bare gaierror (issue 37 item 13)."""
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [f"--checkpoint.dir={url}"])
    scheme = url.split("://")[0]
    assert str(e.value).startswith("config key 'checkpoint.dir' has the scheme") and f"'{scheme}://'" in str(e.value)
    assert "a local path or s3://bucket/prefix" in str(e.value)
    assert load_config(DEMO, ["--checkpoint.dir=s3://bucket/x"]).checkpoint.dir == "s3://bucket/x"
