"""Fail fast, lose nothing, exit honestly (issue 18 items 1-4, 13): what `moerl train` checks before Ray starts
(each failure one `error:` line, exit 2, nothing overwritten, no Ray), the config's refusals, the exit status of a
stopped run, `moerl export`'s refusal of a non-empty directory, and `--help` without torch or Ray."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moerl import preflight
from moerl.checkpoint import CheckpointStore
from moerl.cli import main as cli
from moerl.config import ConfigError, load_config
from moerl.model import CheckpointError, MoEModelConfig, build_model, load_pretrained, save_pretrained
from moerl.model.hf import check_pretrained
from moerl.preflight import PreflightError
from moerl.tasks import TaskError

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.toml")
ARCH = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def train(argv: list[str], capsys) -> tuple[int, list[str], str]:
    """`moerl train DEMO argv...` in this process: (exit status, stderr lines, stdout)."""
    from moerl.train_cli import main

    code = main([DEMO, *argv])
    out = capsys.readouterr()
    return code, out.err.splitlines(), out.out


def no_ray_started() -> bool:
    return "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    save_pretrained(build_model(MoEModelConfig(**ARCH), seed=0), path)
    return path


# ------------------------------------------------------------------------------------------ --help
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
        assert f"\n  [{section}]\n" in out.stdout, section
    assert "--resume" in out.stdout and "exit status" in out.stdout and "143" in out.stdout


def test_train_arguments_are_checked_before_anything_loads(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli(["train", DEMO, "stray"])
    assert e.value.code == 2 and "config overrides are --section.key=value" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("override, key", [
    ("--train.steps=0", "train.steps"), ("--train.optim.lr=0", "train.optim.lr"),
    ("--train.optim.lr=-1e-4", "train.optim.lr"), ("--rollout.group_size=1", "rollout.group_size"),
    ("--train.sft_lr=0", "train.sft_lr"), ("--checkpoint.dir=s3://", "checkpoint.dir"),
    ("--rollout.ep_size=0", "rollout.ep_size"), ("--rollout.max_new_tokens=32", "rollout.max_new_tokens"),
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


# ------------------------------------------------------------------------------------------ model
def _break(path: Path, how: str) -> None:
    file = path / "model.safetensors"
    data = file.read_bytes()
    if how == "truncated":
        file.write_bytes(data[:-100])
    elif how == "header":
        file.write_bytes(data[:8] + b"garbage" + data[15:])
    elif how == "empty":
        file.write_bytes(b"")
    elif how == "model_type":
        (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()),
                                                      "model_type": "llama"}))
    elif how == "shape":
        (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()),
                                                      "moe_intermediate_size": 24}))
    elif how == "no_config":
        (path / "config.json").unlink()


@pytest.mark.parametrize("how, needle", [
    ("truncated", "not a readable safetensors file"), ("header", "invalid JSON in header"),
    ("empty", "header too small"), ("model_type", "model_type 'llama' is not supported"),
    ("shape", "has shape [16, 32], the config.json implies [24, 32]"), ("no_config", "no config.json"),
])
def test_model_dir_is_checked_from_headers_as_load_pretrained_would(model_dir, tmp_path, how, needle) -> None:
    import shutil

    path = tmp_path / "m"
    shutil.copytree(model_dir, path)
    _break(path, how)
    with pytest.raises(CheckpointError) as loaded:
        load_pretrained(path)
    with pytest.raises(CheckpointError) as checked:
        check_pretrained(path)
    assert needle in str(checked.value) and str(checked.value) == str(loaded.value)
    with pytest.raises(PreflightError, match=r"^model\.path: "):
        preflight.check_model(str(path))


def test_good_model_dir_passes_and_its_tokenizer_must_fit(model_dir) -> None:
    arch = preflight.check_model(str(model_dir))
    assert arch.vocab_size == 300

    class Tok:
        vocab_size, eos_token_id = 400, 2

    class Task:
        tokenizer = Tok()

    with pytest.raises(PreflightError, match="tokenizer has 400 ids .* vocabulary has 300"):
        preflight.check_tokenizer(Task(), arch)


def test_expert_parallel_sizes_must_divide_the_experts(model_dir) -> None:
    arch = preflight.check_model(str(model_dir))  # 4 experts
    preflight.check_expert_split(load_config(DEMO, []), arch)  # ep_size 1: today's engine
    with pytest.raises(PreflightError, match=r"'rollout.ep_size' is 3, which does not divide the model's 4 experts"):
        preflight.check_expert_split(load_config(DEMO, ["--rollout.ep_size=3"]), arch)
    with pytest.raises(PreflightError, match=r"'ep.size' is 3"):
        preflight.check_expert_split(load_config(DEMO, ["--ep.size=3", "--train.num_ranks=3"]), arch)
    preflight.check_expert_split(load_config(DEMO, ["--rollout.ep_size=2", "--rollout.gpus_per_worker=2"]), arch)
    with pytest.raises(PreflightError, match=r"'run.deterministic' is not supported with rollout.ep_size > 1"):
        preflight.check_expert_split(load_config(DEMO, ["--rollout.ep_size=2", "--run.deterministic=true"]), arch)
    with pytest.raises(PreflightError, match=r"'rollout.gpus_per_worker' is 1.0, .* set it to 2"):
        preflight.check_expert_split(load_config(DEMO, ["--rollout.ep_size=2", "--rollout.gpus_per_worker=1"]), arch)


def test_missing_model_dir_is_one_line_exit_2_before_ray(tmp_path, capsys) -> None:
    code, err, _ = train([f"--run.dir={tmp_path / 'run'}", f"--model.path={tmp_path / 'nope'}"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: model.path '{tmp_path / 'nope'}' does not exist")
    assert no_ray_started() and not (tmp_path / "run").exists()  # what the checks made is gone again


# ------------------------------------------------------------------------------------------ task
def test_task_problems_are_named(tmp_path) -> None:
    def cfg(*extra: str):
        return load_config(None, [f"--run.dir={tmp_path}", *extra])

    jsonl = "--task.name=moerl.tasks.jsonl:JsonlTask"
    with pytest.raises(TaskError, match="cannot load task 'no_such_module:Task'"):
        preflight.check_task(cfg("--task.name=no_such_module:Task"))
    with pytest.raises(TaskError, match="not found"):
        preflight.check_task(cfg(jsonl, f"--task.options.path={tmp_path / 'none.jsonl'}", "--train.sft_steps=0"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    with pytest.raises(TaskError, match=r"bad\.jsonl:2: invalid JSON"):
        preflight.check_task(cfg(jsonl, f"--task.options.path={tmp_path / 'bad.jsonl'}"))
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(TaskError, match="tokenizer directory .* not found"):
        preflight.check_task(cfg(jsonl, f"--task.options.path={tmp_path / 'ok.jsonl'}",
                                 f"--task.options.tokenizer={tmp_path / 'no-tokenizer'}"))
    assert preflight.check_task(cfg(jsonl, f"--task.options.path={tmp_path / 'ok.jsonl'}")).prompt_at(0)


def test_prompt_and_completion_must_fit_max_seq_len(tmp_path, caplog) -> None:
    """A completion cut short by max_seq_len is said before the run (issue 15's command asked 256 new tokens of
    the demo's max_seq_len = 32 and trained 22-token completions without a word)."""
    (tmp_path / "ok.jsonl").write_text('{"prompt": "12345678+1=", "answer": "12345679"}\n')
    task = ["--task.name=moerl.tasks.jsonl:JsonlTask", f"--task.options.path={tmp_path / 'ok.jsonl'}"]
    n = len(preflight.check_task(load_config(None, task)).prompt_at(0).prompt_token_ids)
    with caplog.at_level(logging.WARNING):
        preflight.check_task(load_config(None, [*task, f"--rollout.max_seq_len={n + 8}", "--rollout.max_new_tokens=7"]))
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        preflight.check_task(load_config(None, [*task, f"--rollout.max_seq_len={n + 8}", "--rollout.max_new_tokens=9"]))
    assert f"cuts its completion at 8 tokens (raise rollout.max_seq_len to {n + 9})" in caplog.text
    with pytest.raises(preflight.PreflightError, match=f"prompt 0 has {n} tokens, rollout.max_seq_len={n}"):
        preflight.check_task(load_config(None, [*task, f"--rollout.max_seq_len={n}", "--rollout.max_new_tokens=1"]))


# ------------------------------------------------------------------------------------------ run.dir
def test_a_run_is_never_overwritten(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": -1, "time": 0.1}\n')  # a warm start only: nothing to lose
    preflight.check_no_run(run, CheckpointStore(str(run / "checkpoints")))
    rows = '{"step": -1, "time": 0.1}\n{"step": 1, "time": 1.0}\n{"step": 2, "time": 2.0}\n'
    (run / "metrics.jsonl").write_text(rows)
    code, err, _ = train([f"--run.dir={run}"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"error: run.dir '{run}' holds a run (metrics.jsonl up to step 2) and a run is never "
                      "overwritten: it has no checkpoint to continue from, so start a new one with "
                      "--run.dir=<another directory> (or delete that one)")
    store = CheckpointStore(str(run / "checkpoints"))
    store.write_bytes(2, "controller.pt", b"x")
    store.commit(2)
    code, err, _ = train([f"--run.dir={run}"], capsys)
    assert code == 2 and "continue it with --resume" in err[0] and "up to step 2" in err[0]
    assert (run / "metrics.jsonl").read_text() == rows and no_ray_started()


def test_run_dir_and_checkpoint_dir_must_be_writable(tmp_path, capsys) -> None:
    (tmp_path / "a-file").write_text("")
    code, err, _ = train([f"--run.dir={tmp_path / 'a-file' / 'run'}"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: run.dir '{tmp_path / 'a-file' / 'run'}' "
                                                             "is not writable: NotADirectoryError")
    code, err, _ = train([f"--run.dir={tmp_path / 'run'}", f"--checkpoint.dir={tmp_path / 'a-file' / 'ck'}"], capsys)
    assert code == 2 and len(err) == 1 and "checkpoint.dir" in err[0] and "is not writable" in err[0]


def test_s3_without_credentials_is_one_line_and_never_prints_a_secret(monkeypatch) -> None:
    pytest.importorskip("s3fs")
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup: offline and fast
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    with pytest.raises(CheckpointError) as e:
        CheckpointStore("s3://moerl-no-bucket/run").probe()
    assert str(e.value).startswith("checkpoint.dir 's3://moerl-no-bucket/run' is not writable: NoCredentialsError")
    assert "no AWS credentials" in str(e.value) and "\n" not in str(e.value)
    from moerl.checkpoint.storage import _redact, _shown

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-MUST-NOT-LEAK")
    assert "s3cr3t" not in _redact("SignatureDoesNotMatch for s3cr3t-MUST-NOT-LEAK")
    assert _shown("s3://AKIA:s3cr3t@bucket/run") == "s3://***@bucket/run"


# ------------------------------------------------------------------------------------------ resume
def _committed(store: CheckpointStore, step: int, fingerprint: dict | None = None) -> None:
    store.write_bytes(step, "controller.pt", b"state %d" % step)
    store.commit(step, {"fingerprint": fingerprint or {}})


def test_resume_without_a_checkpoint_says_why(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path / "ck"))
    with pytest.raises(PreflightError) as e:
        preflight.check_resume(store, {}, every=0)
    assert str(e.value) == (f"--resume: no committed checkpoint under {store.root}; checkpoint.every is 0, so a run "
                            "saves only at its last step or when it is stopped (SIGTERM or Ctrl-C): start without "
                            "--resume")


def test_torn_checkpoint_offers_the_newest_intact_step(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path / "ck"))
    for step in (1, 2, 3):
        _committed(store, step, {"task": "t"})
    assert preflight.check_resume(store, {"task": "t"}, every=1) == 3
    (tmp_path / "ck" / "step-00000003" / "controller.pt").write_bytes(b"torn")
    (tmp_path / "ck" / "step-00000002" / "controller.pt").write_bytes(b"state 9")  # same size, other bytes
    with pytest.raises(PreflightError) as e:
        preflight.check_resume(store, {"task": "t"}, every=1)
    assert str(e.value).startswith("--resume: checkpoint step 3 is torn (") and "controller.pt" in str(e.value)
    assert str(e.value).endswith("the newest intact step is 1: resume from it with --resume-step=1")
    assert preflight.check_resume(store, {"task": "t"}, every=1, step=1) == 1
    with pytest.raises(PreflightError, match=r"--resume-step 7: no committed checkpoint of that step .*1, 2, 3"):
        preflight.check_resume(store, {"task": "t"}, every=1, step=7)
    with pytest.raises(PreflightError, match=r"another configuration: task: checkpoint 't' vs config 'u'"):
        preflight.check_resume(store, {"task": "u"}, every=1, step=1)


# ------------------------------------------------------------------------------------------ exits
def test_sigterm_and_ctrl_c_ask_for_a_stop_and_a_second_ctrl_c_aborts() -> None:
    from moerl.run import StopSignals

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    for first in (signal.SIGTERM, signal.SIGINT):
        signals = StopSignals().install()
        try:
            os.kill(os.getpid(), first)
            assert signals.event.wait(2) and signals.signum == first
            os.kill(os.getpid(), signal.SIGTERM)  # more SIGTERMs: still the one graceful stop
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                signals.event.wait(2)  # the handler raises here, in the main thread
            assert signals.signum == first
        finally:
            signals.restore()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_stopped_run_exits_128_plus_the_signal_and_says_how_to_resume(tmp_path, capsys, monkeypatch) -> None:
    from moerl import run

    results = {"stopped": int(signal.SIGTERM), "step": 54, "steps": 400, "checkpoint_step": 54, "metrics": {}}
    monkeypatch.setattr(run, "train", lambda cfg, **kw: dict(results))
    argv = [f"--run.dir={tmp_path}", "--train.steps=400"]
    code, _, out = train(argv, capsys)
    assert code == 143
    assert out.strip() == f"stopped at step 54 of 400; resume with: moerl train {DEMO} {' '.join(argv)} --resume"
    results.update(stopped=int(signal.SIGINT), checkpoint_step=50)
    code, _, out = train(argv, capsys)
    assert code == 130 and "its checkpoint was not saved" in out and "the newest is step 50" in out
    results.update(step=0, checkpoint_step=None, nothing_trained=True)
    code, _, out = train(argv, capsys)
    assert code == 130 and out.startswith("stopped before step 1 of 400: nothing to resume; start again with: ")

    def abort(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "train", abort)
    code, err, out = train(argv, capsys)
    assert code == 130 and err[-1] == "aborted at step 0 of 400 by a second Ctrl-C; no checkpoint was saved"
    assert "Traceback" not in out


def test_a_failed_run_is_one_line_with_the_traceback_in_the_run_dir(tmp_path, capsys, monkeypatch) -> None:
    from moerl import run

    def fail(cfg, **kw):
        raise RuntimeError("\x1b[31mActorDiedError\x1b[0m: the actor died\n  long Ray detail")

    monkeypatch.setattr(run, "train", fail)
    code, err, _ = train([f"--run.dir={tmp_path}"], capsys)
    assert code == 1 and err == [(f"error: RuntimeError: ActorDiedError: the actor died (traceback in "
                                  f"{tmp_path / 'error.log'})")]
    assert "Traceback" in (tmp_path / "error.log").read_text()
    code, err, _ = train([f"--run.dir={tmp_path}", "--run.log_level=debug"], capsys)
    assert code == 1 and err[0].startswith("Traceback") and err[-1].startswith("error: RuntimeError")


def test_a_trainer_pod_stopped_by_sigterm_exits_143(monkeypatch) -> None:
    from moerl.launch import node

    monkeypatch.setattr(node, "wait_for_head", lambda *a, **k: True)
    monkeypatch.setattr(node, "RayNode", lambda *a, **k: None)
    monkeypatch.setattr(node, "run_node", lambda *a, **k: "stopped")
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert node.main(["trainer", "--rank", "1", "--head", "127.0.0.1:1"]) == 143
        monkeypatch.setattr(node, "run_node", lambda *a, **k: "head lost")
        assert node.main(["trainer", "--rank", "1", "--head", "127.0.0.1:1"]) == 1
    finally:
        signal.signal(signal.SIGTERM, before)


# ------------------------------------------------------------------------------------------ export
def test_export_refuses_a_non_empty_directory_unless_forced(tmp_path, capsys) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli(["export", str(tmp_path / "ck"), str(out)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {out} is not empty: choose another OUT_DIR, or --force to "
                                               "write into it")
    assert cli(["export", str(tmp_path / "ck"), str(out), "--force"]) == 2  # past the check: no checkpoint there
    assert "no committed checkpoint" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"


def test_resume_if_saved_resumes_only_when_a_checkpoint_is_committed(tmp_path, monkeypatch):
    """`moerl launch`'s trainer passes --resume-if-saved: a restarted job continues, its first start begins."""
    from moerl import run, train_cli

    seen: list[bool] = []
    monkeypatch.setattr(run, "prepare", lambda cfg, resume, resume_step, **kw: seen.append(resume) or (_ for _ in ()).throw(
        run.PreflightError("stop here")))
    argv = [DEMO, f"--run.dir={tmp_path}", "--resume-if-saved"]
    assert train_cli.main(argv) == 2 and seen == [False]
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    store.begin(4)
    store.write_bytes(4, "state.bin", b"x")
    store.commit(4)
    assert train_cli.main(argv) == 2 and seen == [False, True]


def test_deterministic_is_refused_on_a_gpu_and_set_in_every_trainer_process(tmp_path) -> None:
    """run.deterministic promises deterministic algorithms: on the CPU every trainer rank and rollout worker turns
    torch's on (an op without a deterministic kernel raises instead of varying); on a GPU, where the grouped GEMMs
    and Triton kernels are not reproducible, it is refused before anything starts."""
    import torch

    from moerl.actors.trainer_actor import TrainerRank, TrainerSpec
    from moerl.train.config import LossConfig, OptimConfig

    cfg = load_config(DEMO, ["--run.deterministic=true"])
    with pytest.raises(PreflightError, match=r"^config key 'run.deterministic' is CPU-only"):
        preflight.check_deterministic(cfg, "cuda")
    preflight.check_deterministic(cfg, "cpu")
    preflight.check_deterministic(load_config(DEMO), "cuda")  # off: nothing to refuse
    spec = TrainerSpec(arch={}, model_path="", dtype="float32", device="cpu", optim=OptimConfig(), loss=LossConfig(),
                       ep_size=1, dispatcher="auto", routing_replay=True, aux_loss_coef=0.0, expert_bias_rate=0.0,
                       capacity_factor=0.0, seed=0, deterministic=True)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        TrainerRank(0, 1, spec)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


# ------------------------------------------------------------------------------------------ issue 27: inputs
def test_a_model_dir_without_tokenizer_files_is_refused_as_the_tokenizer(model_dir, tmp_path, capsys) -> None:
    """A model directory without tokenizer files loaded as a tokenizer of one id: every prompt was zero tokens
    (the warm start crashed after Ray started, or RL hung at step 0)."""
    from moerl.tasks.tokenizer import make_tokenizer

    with pytest.raises(TaskError) as e:
        make_tokenizer(str(model_dir))
    assert f"tokenizer directory {str(model_dir)!r} has no tokenizer files" in str(e.value)
    assert "tokenizer.json" in str(e.value) and "holds config.json, model.safetensors" in str(e.value)
    code, err, _ = train([f"--run.dir={tmp_path / 'run'}", f"--task.options.tokenizer={model_dir}"], capsys)
    assert code == 2 and len(err) == 1 and "has no tokenizer files" in err[0], err
    assert no_ray_started() and not (tmp_path / "run").exists()


def test_a_prompt_of_no_tokens_is_refused(tmp_path, monkeypatch) -> None:
    from moerl.tasks.tokenizer import ByteTokenizer

    monkeypatch.setattr(ByteTokenizer, "encode", lambda self, text: [])
    cfg = load_config(DEMO, ["--train.sft_steps=0"])
    monkeypatch.setattr(ByteTokenizer, "bos_token_id", None)
    with pytest.raises(PreflightError, match=r"prompt 0 is no tokens: .*task.options.tokenizer"):
        preflight.check_task(cfg)


def test_run_device_cuda_without_a_gpu_is_one_line_before_ray(tmp_path, capsys, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err, _ = train([f"--run.dir={tmp_path / 'run'}", "--run.device=cuda"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: config key 'run.device' is 'cuda' but this machine has no CUDA GPU"), err
    assert no_ray_started() and not (tmp_path / "run").exists()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_ray_address_is_one_line_within_seconds(tmp_path, capsys) -> None:
    import socket
    import time

    port = _closed_port()
    t0 = time.monotonic()
    code, err, _ = train([f"--run.dir={tmp_path / 'run'}", f"--ray.address=127.0.0.1:{port}",
                          "--ray.connect_timeout_s=1"], capsys)
    assert time.monotonic() - t0 < 30
    assert code == 2 and err[-1].startswith(f"error: ray.address '127.0.0.1:{port}': nothing answers there"), err
    assert all(not line.startswith("error") for line in err[:-1]) and no_ray_started()
    with pytest.raises(PreflightError, match=r"ray.address 'ray://127.0.0.1:\d+': nothing answers"):
        preflight.check_ray_address(f"ray://127.0.0.1:{port}", 0.5)
    with socket.socket() as server:  # something listens: the check passes at once (Ray's own errors are Ray's)
        server.bind(("127.0.0.1", 0))
        server.listen()
        preflight.check_ray_address(f"127.0.0.1:{server.getsockname()[1]}", 5)
    preflight.check_ray_address("auto", 0.5)  # Ray finds a local cluster itself


def test_sigterm_while_waiting_for_ray_exits_143_with_a_stopped_line(tmp_path) -> None:
    import time

    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "moerl.cli", "train", DEMO, f"--run.dir={tmp_path / 'run'}",
                             f"--ray.address=127.0.0.1:{_closed_port()}", "--ray.connect_timeout_s=120"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # blocks until the wait starts (bounded by the test's timeout)
        assert "waiting for Ray at 127.0.0.1:" in line, line
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and time.monotonic() - t0 < 30
    assert (out + err).strip().splitlines()[-1] == "stopped by SIGTERM before the run started: nothing was trained"
    assert not (tmp_path / "run").exists()


def test_a_local_ray_gets_its_auth_mode_before_ray_is_imported(tmp_path) -> None:
    """`make demo` printed Ray's token warning on every run: `moerl train` imported Ray (for TrainerLost) before
    it set RAY_AUTH_MODE, so Ray chose the mode itself and said so."""
    code = f"""if True:
        import os, sys
        os.environ.pop("RAY_AUTH_MODE", None)
        from moerl import run, train_cli
        seen = {{}}
        def fake(cfg, **kw):
            seen["mode"] = os.environ.get("RAY_AUTH_MODE")
            raise SystemExit(0)
        run.train = fake
        try:
            train_cli.main([{DEMO!r}, "--run.dir={tmp_path / 'run'}"])
        except SystemExit:
            pass
        assert seen == {{"mode": "token"}}, seen
    """
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


@pytest.mark.parametrize("override, needle", [
    ("--rollout.group_size=100000000", "config key 'rollout.group_size' is 100000000, more than one engine's batch "
                                       "(rollout.max_batch_size=64)"),
    ("--rollout.kv_cache_tokens=100", "a group of 8 x rollout.max_seq_len=32 tokens needs 256 tokens of KV cache, one "
                                      "engine holds 100 (rollout.kv_cache_tokens)"),
])
def test_a_group_one_engine_cannot_hold_is_refused_before_ray(override, needle, tmp_path, capsys,
                                                              monkeypatch) -> None:
    """--rollout.group_size=100000000 passed every check; the driver then sat at 7.5 GB while workers were called
    stuck and replaced, and nothing named the group size (issue 37 item 12)."""
    from moerl import run

    monkeypatch.setattr(run, "train", lambda cfg, **kw: pytest.fail("the run started"))
    code, err, _ = train([f"--run.dir={tmp_path / 'run'}", override], capsys)
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert no_ray_started()


def test_a_step_batch_over_the_drivers_memory_is_refused_naming_the_keys() -> None:
    from moerl.run import model_architecture
    from moerl.tasks.arithmetic import ArithmeticTask

    cfg = load_config(DEMO, ["--rollout.max_batch_size=4096", "--rollout.group_size=4096"])
    arch = model_architecture(cfg, ArithmeticTask())
    tokens = 8 * 4096 * 32
    with pytest.raises(PreflightError) as e:
        preflight.check_capacity(cfg, arch, available=tokens * preflight.driver_bytes_per_token(arch))
    assert str(e.value).startswith("config keys 'train.batch_groups' x 'rollout.group_size' x 'rollout.max_seq_len' "
                                   f"(8 x 4096 x 32 = {tokens} tokens) make a step's batch of up to ")
    assert "lower train.batch_groups or rollout.group_size" in str(e.value)
    preflight.check_capacity(cfg, arch, available=3 * tokens * preflight.driver_bytes_per_token(arch))
    preflight.check_capacity(load_config(DEMO), arch)  # the demo, on this machine
