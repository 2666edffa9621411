"""The commands' first answers (issue 18 items 4, 13): the config's refusals, `moerl config`'s check of the task's
options, `moerl export`'s refusal of a non-empty directory, and `--help` without torch or Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moerl.cli import main as cli
from moerl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.toml")


def test_every_help_answers_without_torch_or_ray() -> None:
    """`moerl train --help` lists the config sections; no subcommand's --help imports torch or Ray (what makes
    them answer in well under a second)."""
    code = """if True:
        import contextlib, io, sys
        from moerl.cli import main
        for argv in (["train", "--help"], ["config", "--help"], ["export", "--help"], ["launch", "--help"],
                     ["bench", "--help"], ["--help"]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    code = main(argv)
                except SystemExit as e:
                    code = e.code
            assert code == 0 and "usage" in out.getvalue(), (argv, code, out.getvalue())
        heavy = sorted(m for m in ("torch", "ray", "torchx", "s3fs") if m in sys.modules)
        assert not heavy, heavy
    """
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    out = subprocess.run([sys.executable, "-m", "moerl.cli", "train", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    for section in ("run", "model", "rollout", "train.loss", "train.optim", "checkpoint", "task", "launch"):
        assert f"\n  {section} " in out.stdout, section
    assert "--resume" in out.stdout and "exit status" in out.stdout and "143" in out.stdout


def test_train_arguments_are_checked_before_anything_loads(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli(["train", DEMO, "stray"])
    assert e.value.code == 2 and "config overrides are --section.key=value" in capsys.readouterr().err


@pytest.mark.parametrize("override, key", [
    ("--train.steps=0", "train.steps"), ("--train.optim.lr=0", "train.optim.lr"),
    ("--train.optim.lr=-1e-4", "train.optim.lr"), ("--rollout.group_size=1", "rollout.group_size"),
    ("--train.sft_lr=0", "train.sft_lr"), ("--checkpoint.dir=s3://", "checkpoint.dir"),
])
def test_values_that_cannot_work_are_refused_by_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [override])
    assert str(e.value).startswith(f"config key {key!r} must be"), str(e.value)


def test_moerl_config_checks_task_options_against_the_tasks_option_class(capsys) -> None:
    assert cli(["config", DEMO, "--task.options.max_operandd=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "unknown option 'max_operandd'" in err and "max_operand" in err
    assert cli(["config", DEMO, "--task.options.max_operand=-1"]) == 2
    assert "'max_operand' must be >= 0" in capsys.readouterr().err
    assert cli(["config", DEMO, "--task.options.max_operand=5"]) == 0
    assert "max_operand = 5" in capsys.readouterr().out


def test_export_refuses_a_non_empty_directory_unless_forced(tmp_path, capsys) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli(["export", str(tmp_path / "ck"), str(out)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {out} is not empty: choose another OUT_DIR, or --force to "
                                               "write into it")
    assert cli(["export", str(tmp_path / "ck"), str(out), "--force"]) == 2  # past the check: no checkpoint there
    assert "no committed checkpoint" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
