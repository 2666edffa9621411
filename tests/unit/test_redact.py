"""No secret reaches a line moerl prints or writes (issue 27 item 5): config errors of `moerl config` and `moerl
train`, `moerl config`'s output, event lines (console and error.log) and a failed run's error line and traceback."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from moerl.cli import main as cli
from moerl.redact import MASK, looks_secret, redact, redact_config, secret_key

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.toml")
# known secret names, each with a value that must never be printed
SECRETS = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY", "GITHUB_TOKEN": "ghp-TOKEN-VALUE-0042",
           "DB_PASSWORD": "hunter2-PASSWORD-VALUE", "OPENAI_API_KEY": "sk-API-KEY-VALUE-0042",
           "HF_TOKEN": "hf_TOKEN_VALUE_0042", "MY_SERVICE_KEY": "service-KEY-VALUE-0042"}


def assert_clean(*texts: str) -> None:
    for text in texts:
        leaked = [name for name, value in SECRETS.items() if value in text]
        assert not leaked, f"{leaked} leaked in: {text}"


def test_names_and_values() -> None:
    for name in SECRETS:
        assert looks_secret(name), name
    assert not looks_secret("TOKENIZERS_PARALLELISM") and not looks_secret("OMP_NUM_THREADS")
    assert secret_key("task.options.api_key") and secret_key("hf_token") and secret_key("launch.env.GITHUB_TOKEN")
    assert not secret_key("task.options.answer_key") and not secret_key("prompt_key")
    assert not secret_key("rollout.max_new_tokens") and not secret_key("tokenizer")
    text = ("{'AWS_SECRET_ACCESS_KEY': 'wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY'} GITHUB_TOKEN=ghp-TOKEN-VALUE-0042 "
            "\"DB_PASSWORD\" = \"hunter2-PASSWORD-VALUE\" s3://AKIA:sk-API-KEY-VALUE-0042@bucket/run OMP_NUM_THREADS=1")
    out = redact(text, env={})
    assert_clean(out)
    assert "'AWS_SECRET_ACCESS_KEY': '***'" in out and "s3://***@bucket/run" in out and "OMP_NUM_THREADS=1" in out
    assert_clean(redact(f"boom: {SECRETS['HF_TOKEN']} failed", env=SECRETS))
    assert redact_config({"dir": "s3://a:b@x", "options": {"api_key": "v", "answer_key": "a"}}) == {
        "dir": f"s3://{MASK}@x", "options": {"api_key": MASK, "answer_key": "a"}}


@pytest.mark.parametrize("command", ["config", "train"])
@pytest.mark.parametrize("name", sorted(SECRETS))
def test_a_refused_credential_in_launch_env_is_never_echoed(command, name, tmp_path, capsys) -> None:
    code = cli([command, DEMO, f"--run.dir={tmp_path / 'run'}", f'--launch.env={{{name}="{SECRETS[name]}"}}'])
    err = capsys.readouterr().err
    assert code == 2 and f"'launch.env' entry {name!r} looks like a credential" in err, err
    assert_clean(err)


def test_other_config_errors_never_echo_a_secret(tmp_path, capsys) -> None:
    value = SECRETS["AWS_SECRET_ACCESS_KEY"]
    assert cli(["config", DEMO, f"--launch.secret_env.AWS_SECRET_ACCESS_KEY={value}"]) == 2  # a value, not a ref
    err = capsys.readouterr().err
    assert "not 'secret-name/key'" in err
    config = tmp_path / "c.toml"
    config.write_text(f'[launch.env]\nGITHUB_TOKEN = ["{SECRETS["GITHUB_TOKEN"]}"]\n')
    assert cli(["config", str(config)]) == 2
    err2 = capsys.readouterr().err
    assert "launch.env.GITHUB_TOKEN" in err2
    assert_clean(err, err2)


def test_moerl_config_output_masks_credentials(capsys) -> None:
    value = SECRETS["AWS_SECRET_ACCESS_KEY"]
    assert cli(["config", DEMO, f"--checkpoint.dir=s3://AKIAEXAMPLE:{value}@bucket/run",
                f"--ray.address=ray://user:{SECRETS['DB_PASSWORD']}@head:10001"]) == 0
    out = capsys.readouterr().out
    assert 'dir = "s3://***@bucket/run"' in out and 'address = "ray://***@head:10001"' in out
    assert_clean(out)


def test_event_lines_and_error_log_are_redacted(tmp_path, monkeypatch) -> None:
    from moerl.runlog.reporter import RunReporter

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    stream = io.StringIO()
    report = RunReporter(tmp_path, 5, stream=stream, tty=False, tensorboard=False, plot_every_s=0)
    report.event("warning", f"checkpoint failed: SignatureDoesNotMatch for {SECRETS['AWS_SECRET_ACCESS_KEY']}")
    report.event("checkpoint", f"saved to s3://AKIA:{SECRETS['OPENAI_API_KEY']}@bucket/x")
    report.stage(f"joining Ray at ray://u:{SECRETS['DB_PASSWORD']}@head:10001 with HF_TOKEN={SECRETS['HF_TOKEN']}")
    report.close()
    assert (tmp_path / "error.log").read_text().count("***") == 1
    assert_clean(stream.getvalue(), (tmp_path / "error.log").read_text(), *(t for _, t in report.events))


def test_a_failed_runs_error_line_and_traceback_are_redacted(tmp_path, monkeypatch, capsys) -> None:
    from moerl import run, train_cli

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)

    def fail(cfg, **kw):
        raise RuntimeError(f"S3 said no to {SECRETS['AWS_SECRET_ACCESS_KEY']} (GITHUB_TOKEN={SECRETS['GITHUB_TOKEN']})")

    monkeypatch.setattr(run, "train", fail)
    for extra in ([], ["--run.log_level=debug"]):
        assert train_cli.main([DEMO, f"--run.dir={tmp_path}", *extra]) == 1
        assert_clean(capsys.readouterr().err)
    assert "Traceback" in (tmp_path / "error.log").read_text()
    assert_clean((tmp_path / "error.log").read_text())


# values that hold a credential under a neutral name (issue 37 item 6): each refused, never echoed
SECRET_VALUES = {"DATABASE_URL": "postgres://app:hunter2-PASSWORD-VALUE@db:5432/x",
                 "LLM_KEYS": "sk-proj-Abc123Def456Ghi789Jkl012", "REPO": "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
                 "AWS_ID": "AKIAIOSFODNN7EXAMPLE", "MODEL_HUB": "hf_abcdefghijklmnopqrstuvwxyzABCDEF"}


@pytest.mark.parametrize("name", sorted(SECRET_VALUES))
def test_a_credential_under_a_neutral_name_in_launch_env_is_refused_by_its_value(name, tmp_path, capsys) -> None:
    value = SECRET_VALUES[name]
    assert cli(["config", DEMO, f'--launch.env={{{name}="{value}"}}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'launch.env' entry {name!r} holds " in err[0] and "launch.secret_env" in err[0], err
    assert value not in err[0] and value.split("@")[0] not in err[0]
    assert redact(f"x {value} y", env={}) != f"x {value} y"  # and masked wherever it would be printed


def test_ordinary_values_pass_the_value_screen() -> None:
    from moerl.redact import secret_in_value

    for value in ("false", "s3://bucket/prefix", "https://example.com/path", "/data/sk-models", "risk-averse",
                  "us-east-1", "https://user@host/repo", "1", "TOKENIZERS", "task-skip-0"):
        assert secret_in_value(value) is None, value
