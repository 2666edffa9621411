"""A run keeps what it trained (issue 27 item 1): the last step is always saved, a save can also export the
policy as a Hugging Face directory, and `moerl export` names the step it wrote and warns when it is not the run's
last; the end-of-run summary and the progress line (item 10)."""

from __future__ import annotations

import json

import pytest

from moerl.cli import main as cli
from tests.unit.test_controller import FakeCheckpoints, controller


@pytest.mark.parametrize("every, saved", [(0, [6]), (4, [4, 6]), (3, [3, 6])])
def test_a_finished_run_saves_its_last_step(every, saved):
    """checkpoint.every = 0 (the default) kept nothing of a finished run; every = 4 of 6 steps kept step 4 only."""
    ctl, _, _ = controller(workers=("w0",), auto=True, steps=6, checkpoint_every=every)
    ctl.checkpoints = FakeCheckpoints()
    assert ctl.run().step == 6
    assert [s for s, _, _ in ctl.checkpoints.saves] == saved


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A run directory whose checkpoints hold committed steps 1 and 2, each also exported as a HF directory."""
    from moerl.actors import checkpointer
    from tests.unit.test_checkpoint_trainer import _InProcessGroup, futures_as_ray_refs, trained

    run_dir = tmp_path_factory.mktemp("run")
    events: list[tuple[str, str]] = []
    with pytest.MonkeyPatch.context() as mp:  # module-scoped: no monkeypatch fixture
        futures_as_ray_refs(mp)
        tr = trained(steps=1, bias_rate=0.0)
        ckpt = checkpointer.Checkpointer(str(run_dir / "checkpoints"), keep=1, arch=tr.model.config, fingerprint={},
                                         hf_export=str(run_dir / "hf"), on_event=lambda k, t: events.append((k, t)))
        for step in (1, 2):
            ckpt.save(step, _InProcessGroup(tr), {"step": step})
            ckpt.wait()
    return run_dir, events


def test_every_save_can_export_the_policy_as_a_hugging_face_directory(checkpointed):
    transformers = pytest.importorskip("transformers")
    run_dir, events = checkpointed
    out = run_dir / "hf" / "step-00000002"
    assert ("checkpoint", f"checkpoint step 2 exported (Hugging Face) to {out}") in events
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step-00000002"]  # checkpoint.keep = 1
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.model_type == "qwen3_moe"


def test_export_names_its_step_and_warns_when_it_is_not_the_runs_last(checkpointed, tmp_path, capsys):
    run_dir, _ = checkpointed
    assert cli(["export", str(run_dir / "checkpoints"), str(tmp_path / "a")]) == 0
    captured = capsys.readouterr()
    assert "export: step 2, the newest committed step" in captured.out
    assert captured.out.strip().splitlines()[-1].startswith(f"exported step 2 to {tmp_path / 'a'}: ")
    assert "not the run's last" not in captured.out + captured.err
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (-1, 1, 2, 3, 4, 5)))
    try:
        assert cli(["export", str(run_dir / "checkpoints"), str(tmp_path / "b")]) == 0
    finally:
        (run_dir / "metrics.jsonl").unlink()
    captured = capsys.readouterr()
    assert ("warning: step 2 is not the run's last: it logged steps up to 5 in "
            f"{run_dir / 'metrics.jsonl'}, after its newest checkpoint") in captured.err
