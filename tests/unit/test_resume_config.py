"""`--resume` says what it restores and refuses a changed experiment (issue 27 item 2); a run that cannot be resumed
gets the same advice from a plain re-run and from `--resume` (item 9). All before Ray starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moerl import preflight
from moerl.checkpoint import CheckpointStore
from moerl.config import load_config
from moerl.preflight import PreflightError
from moerl.resume import check_config, config_changes, saved_config

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.toml")


def test_config_changes_split_the_experiment_from_the_rest() -> None:
    saved = saved_config(load_config(DEMO, []))
    current = saved_config(load_config(DEMO, ["--train.steps=900", "--rollout.num_workers=3", "--rollout.group_size=4",
                                              "--train.optim.lr=0.001", "--task.options={}"]))
    accepted, refused = config_changes(saved, current)
    assert accepted == ["rollout.num_workers 2 -> 3", "train.steps 600 -> 900"]
    assert refused == ["rollout.group_size 8 -> 4", "train.optim.lr 0.0005 -> 0.001",
                       "task.options.max_operand 9 -> '(unset)'", "task.options.ops '+' -> '(unset)'"]
    accepted, refused = config_changes(saved, current, ["rollout.group_size", "train.optim", "task.options"])
    assert not refused and len(accepted) == 6


def test_a_changed_experiment_is_refused_listing_every_difference() -> None:
    manifest = {"config": saved_config(load_config(DEMO, []))}
    cfg = load_config(DEMO, ["--rollout.group_size=4", "--train.optim.lr=0.001", "--train.steps=900"])
    with pytest.raises(PreflightError) as e:
        check_config(manifest, cfg, 20)
    assert str(e.value) == (
        "--resume: checkpoint step 20 was trained with another experiment: rollout.group_size 8 -> 4; "
        "train.optim.lr 0.0005 -> 0.001; to resume with the change anyway name each key (--resume-override "
        "rollout.group_size --resume-override train.optim.lr), or start a new run with --run.dir=<another directory>")
    assert check_config(manifest, cfg, 20, ["rollout.group_size", "train.optim.lr"]) == [
        "rollout.group_size 8 -> 4", "train.optim.lr 0.0005 -> 0.001", "train.steps 600 -> 900"]
    with pytest.raises(PreflightError, match=r"^--resume-override rollout.groupsize: not a config key or section$"):
        check_config(manifest, cfg, 20, ["rollout.groupsize"])
    assert check_config({}, cfg, 20) == []  # a checkpoint of an older moerl records no config


# ------------------------------------------------------------------------------------------ through moerl train
def _checkpoint(run_dir: Path, step: int, argv: list[str], commit: bool = True) -> CheckpointStore:
    """A committed checkpoint of `step` as `moerl train DEMO argv` would have written it (no trainer files)."""
    from moerl.run import _fingerprint, model_architecture

    cfg = load_config(DEMO, [f"--run.dir={run_dir}", *argv])
    arch = model_architecture(cfg, preflight.check_task(cfg))
    store = CheckpointStore(str(run_dir / "checkpoints"))
    store.write_bytes(step, "controller.pt", b"state")
    if commit:
        store.commit(step, {"fingerprint": _fingerprint(cfg, arch), "config": saved_config(cfg),
                            "trained": {"samples": step * 64}})
    return store


def _metrics(run_dir: Path, last: int) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(-2, last + 1)))


def _main(argv: list[str], capsys, monkeypatch) -> tuple[int, list[str], dict]:
    from moerl import run, train_cli

    seen: dict = {}

    def fake_train(cfg, *, resume=False, prepared=None, **kw):
        seen.update(notes=list(prepared.notes), step=prepared.resume_step)
        return {"stopped": None, "step": cfg.train.steps, "steps": cfg.train.steps, "metrics": {}, "counters": {},
                "checkpoint_step": cfg.train.steps}
    monkeypatch.setattr(run, "train", fake_train)
    code = train_cli.main([DEMO, *argv])
    return code, capsys.readouterr().err.splitlines(), seen


def test_resume_refuses_a_changed_experiment_and_says_what_it_restores(tmp_path, capsys, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 5, [])
    _metrics(run_dir, 9)
    code, err, seen = _main([f"--run.dir={run_dir}", "--resume", "--rollout.group_size=4", "--train.optim.lr=0.001"],
                            capsys, monkeypatch)
    assert code == 2 and len(err) == 1 and not seen, err
    assert "rollout.group_size 8 -> 4; train.optim.lr 0.0005 -> 0.001" in err[0]
    code, err, seen = _main([f"--run.dir={run_dir}", "--resume", "--rollout.group_size=4", "--rollout.num_workers=3",
                             "--resume-override", "rollout.group_size"], capsys, monkeypatch)
    assert code == 0 and seen["step"] == 5, err
    assert seen["notes"] == [
        f"resuming from checkpoint step 5 under {run_dir / 'checkpoints'} (320 samples trained)",
        "rolling back 4 logged steps (6-9): their rows in metrics.jsonl and trajectories.jsonl are dropped, and they "
        "are trained again",
        "config changed since step 5 (not the experiment): rollout.group_size 8 -> 4, rollout.num_workers 2 -> 3"]


def test_resume_with_fewer_steps_than_saved_is_said_not_done_silently(tmp_path, capsys, monkeypatch) -> None:
    """`--resume --train.steps=62` cut the metrics of a longer run back to step 62 without a word."""
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 100, [])
    _metrics(run_dir, 100)
    code, err, seen = _main([f"--run.dir={run_dir}", "--resume", "--train.steps=62"], capsys, monkeypatch)
    assert code == 2 and not seen and err == [
        "error: --resume: checkpoint step 100 is past train.steps=62: resuming would train nothing and cut the run's "
        "logs back; set --train.steps above 100 to train on"]
    code, out_err, seen = _main([f"--run.dir={run_dir}", "--resume", "--train.steps=100"], capsys, monkeypatch)
    assert code == 0 and not seen  # complete: nothing to train, no Ray
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 103  # nothing cut


def test_a_save_cut_short_gets_the_same_advice_from_both_commands(tmp_path, capsys, monkeypatch) -> None:
    """A crash (or a second Ctrl-C) during the only save: a plain re-run said `continue it with --resume`, and
    `--resume` said `start without --resume`."""
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 5, [], commit=False)
    _metrics(run_dir, 5)
    code, plain, _ = _main([f"--run.dir={run_dir}"], capsys, monkeypatch)
    code2, resumed, _ = _main([f"--run.dir={run_dir}", "--resume"], capsys, monkeypatch)
    assert code == code2 == 2 and len(plain) == len(resumed) == 1
    advice = "--run.dir=<another directory> (or delete that one)"
    for line in (plain[0], resumed[0]):
        assert advice in line and "step 5" in line and "did not finish" in line, line
        assert "--resume," not in line and "start without --resume" not in line, line
    _checkpoint(run_dir, 3, [])  # an older save committed: both say resume, and --resume says from where
    code, plain, _ = _main([f"--run.dir={run_dir}"], capsys, monkeypatch)
    assert code == 2 and "continue it with --resume" in plain[0]
    code, _, seen = _main([f"--run.dir={run_dir}", "--resume"], capsys, monkeypatch)
    assert code == 0 and seen["step"] == 3
    assert seen["notes"][1] == "step 5's save did not finish (never committed): step 3 is the newest intact checkpoint"


def test_a_second_ctrl_c_says_the_same(tmp_path, capsys, monkeypatch) -> None:
    from moerl import run, train_cli

    run_dir = tmp_path / "run"

    def abort(cfg, **kw):
        _metrics(run_dir, 7)
        _checkpoint(run_dir, 7, [], commit=False)  # the save the second Ctrl-C cut short
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "train", abort)
    assert train_cli.main([DEMO, f"--run.dir={run_dir}"]) == 130
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("aborted at step 7 of 600 by a second Ctrl-C; no checkpoint was saved: nothing to resume; "
                       "start a new run with --run.dir=<another directory> (or delete that one)")


def test_resume_step_of_an_older_checkpoint_does_not_call_newer_ones_unsaved(tmp_path, capsys, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 3, [])
    _checkpoint(run_dir, 6, [])
    _metrics(run_dir, 6)
    code, _, seen = _main([f"--run.dir={run_dir}", "--resume-step", "3"], capsys, monkeypatch)
    assert code == 0 and seen["step"] == 3
    assert not any("did not finish" in note for note in seen["notes"]), seen["notes"]
    assert seen["notes"][1].startswith("rolling back 3 logged steps (4-6)")


@pytest.mark.parametrize("argv, needle", [
    (["--resume-override", "rollout.group_size"], "--resume-override applies to a resumed run only"),
    (["--resume", "--resume-step", "5"], "argument --resume-step: not allowed with argument --resume"),
])
def test_resume_flags_that_contradict_each_other_are_refused(argv, needle, capsys, monkeypatch, tmp_path) -> None:
    """--resume-override without --resume was ignored, and --resume with --resume-step accepted though the usage
    calls them exclusive (issue 37 item 13): refused before anything loads, exit 2."""
    from moerl import train_cli
    from moerl.cli import main as cli

    monkeypatch.setattr(train_cli, "main", lambda argv: 0)  # what would have run: the job itself
    with pytest.raises(SystemExit) as e:
        cli(["train", "configs/demo.toml", f"--run.dir={tmp_path}", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err
