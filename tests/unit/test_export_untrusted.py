"""`moerl export` of a checkpoint that may be forged (issue 37 items 4, 7, 8, 9, 11, 13): only the tokenizer and
generation files it knows are copied, never over the weights it writes and never code; the output appears whole or
not at all; a manifest without checksums, a `.metadata` shape that arch.json does not allow and an over-long or
unprintable key are refused in one line before anything is allocated or written; the messages name what is there."""

from __future__ import annotations

import json
import os
import pickle
import stat

import pytest
import torch

from moerl.checkpoint import CheckpointError, CheckpointStore, export_policy, save_trainer_state, write_arch
from moerl.checkpoint.untrusted import check_key
from moerl.cli import main as cli
from tests.unit.test_checkpoint_trainer import reseal, trained

CONFIG = {"task": {"name": "moerl.tasks.arithmetic:ArithmeticTask", "options": {}}}


def commit_step(root, step: int = 1, hf: dict[str, bytes] | None = None, config: dict | None = CONFIG,
                tr=None) -> CheckpointStore:
    """A committed step as the Checkpointer writes one: trainer state, arch.json, `hf/` files, the run's config."""
    tr = tr or trained(steps=1, bias_rate=0.0)
    store = CheckpointStore(str(root))
    sums = save_trainer_state(tr, f"{store.step_path(step)}/trainer", use_async=False).result()
    write_arch(store, step, tr.model.config)
    for name, data in (hf or {}).items():
        store.write_bytes(step, f"hf/{name}", data)
    store.commit(step, {"config": config} if config else {}, checksums={f"trainer/{k}": v for k, v in sums.items()})
    return store


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------ item 4
def test_export_copies_only_the_serving_files_it_knows_and_never_code(tmp_path, capsys):
    """A forged `hf/` held model.safetensors (4 bytes), config.json, a `.py` module and a tokenizer_config.json whose
    auto_map points at it: export wrote its weights, then copied every file over them and beside them."""
    tokenizer_config = {"eos_token": "<eos>", "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}
    generation = {"eos_token_id": 2, "temperature": 0.7}
    store = commit_step(tmp_path / "ckpts", hf={
        "model.safetensors": b"evil", "config.json": b"{}", "evil.py": b"import os; os.system('touch pwned')\n",
        "tokenizer_config.json": json.dumps(tokenizer_config).encode(),
        "generation_config.json": json.dumps(generation).encode()})
    out = tmp_path / "out"
    assert cli(["export", store.root, str(out)]) == 0
    err = capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer_config.json"]
    from safetensors.torch import load_file

    assert "model.embed_tokens.weight" in load_file(out / "model.safetensors")  # the policy, not the 4 bytes
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"eos_token": "<eos>"}
    assert json.loads((out / "generation_config.json").read_text()) == generation
    assert "left out 3 file(s) under hf/" in err and "'evil.py'" in err and "dropped its 'auto_map'" in err


def test_a_failed_export_leaves_no_half_written_output(tmp_path, monkeypatch):
    from moerl.checkpoint import export

    store = commit_step(tmp_path / "ckpts")

    def fail_after_config(model, path):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{}")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(export, "save_pretrained", fail_after_config)
    with pytest.raises(OSError, match="No space left"):
        export_policy(store.root, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["ckpts"]  # no output, no staging directory


def test_force_into_an_earlier_export_replaces_its_weights_whole(tmp_path):
    store = commit_step(tmp_path / "ckpts")
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old shard")
    (out / "model.safetensors.index.json").write_text("{}")  # would make a loader read the old shards
    export_policy(store.root, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]


# ------------------------------------------------------------------------------------------ item 7
@pytest.mark.parametrize("how", ["no table", "one file without"])
def test_a_manifest_without_checksums_is_refused_not_read_unchecked(tmp_path, how, capsys):
    store = commit_step(tmp_path / "ckpts")
    commit = tmp_path / "ckpts" / "step-00000001" / "COMMIT"
    manifest = json.loads(commit.read_text())
    victim = max((n for n in manifest["files"] if n.endswith(".distcp")), key=manifest["files"].get)
    if how == "no table":
        del manifest["checksums"]
    else:
        del manifest["checksums"][victim]
    commit.write_text(json.dumps(manifest))
    path = tmp_path / "ckpts" / "step-00000001" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # a flipped byte that only the checksum would catch
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="cannot be checked: refused" if how != "no table" else
                       "no 'checksums' table"):
        store.verify(1)
    assert cli(["export", store.root, str(tmp_path / "out")]) == 2
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("error: ") and "checksum" in err[0]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ item 8
def test_an_absurd_metadata_shape_is_compared_with_arch_json_before_anything_is_allocated(tmp_path, monkeypatch):
    from moerl.checkpoint import export
    from moerl.checkpoint.trainer_state import _MetadataUnpickler

    store = commit_step(tmp_path / "ckpts")
    ck = tmp_path / "ckpts" / "step-00000001" / "trainer"
    with open(ck / ".metadata", "rb") as f:
        meta = _MetadataUnpickler(f).load()
    entry = meta.state_dict_metadata["model/model.norm.weight"]
    entry.size = torch.Size([2 ** 40])
    entry.chunks[0].sizes = torch.Size([2 ** 40])
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    reseal(store, 1)  # the forger rewrites the manifest too

    def never(*args, **kwargs):
        raise AssertionError("tensors were allocated before the shapes were checked")
    monkeypatch.setattr(export, "load_into", never)
    with pytest.raises(CheckpointError, match=r"'model/model.norm.weight' is \[1099511627776\] in the checkpoint, "
                                              r"\[64\] per its arch.json"):
        export_policy(store.root, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ item 9
@pytest.mark.parametrize("key, needle", [
    ("hf/" + "a" * 900, "longer than a file name may be"),
    ("hf/tokenizer\u202enosj.json", "not a plain relative path"),  # a right-to-left override
    ("hf/token\u2028izer.json", "not a plain relative path"),  # a line separator
    ("hf/a\x85b", "not a plain relative path"),  # NEL, a C1 control
])
def test_over_long_and_unprintable_keys_are_refused_in_one_line(tmp_path, capsys, key, needle):
    with pytest.raises(CheckpointError, match=needle):
        check_key(key, "where")
    store = commit_step(tmp_path / "ckpts")
    commit = tmp_path / "ckpts" / "step-00000001" / "COMMIT"
    manifest = json.loads(commit.read_text())
    manifest["files"][key] = 4  # on S3 such a key exists; locally the manifest alone names it
    manifest["checksums"][key] = "crc32:00000000"
    commit.write_text(json.dumps(manifest))
    assert cli(["export", store.root, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not any(c in err for c in "\u202e\u2028\x85") and len(err) < 600
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ item 11
def test_export_of_an_older_step_names_the_newer_committed_one_and_a_missing_step_is_refused(tmp_path, capsys):
    tr = trained(steps=1, bias_rate=0.0)
    store = commit_step(tmp_path / "ckpts", 1, tr=tr)
    commit_step(tmp_path / "ckpts", 2, tr=tr)
    assert cli(["export", store.root, str(tmp_path / "out"), "--step", "1"]) == 0
    err = capsys.readouterr().err
    assert "never committed" not in err
    assert "step 1 is not the newest committed step" in err and "step 2 is (export it without --step)" in err
    assert cli(["export", store.root, str(tmp_path / "out7"), "--step", "7"]) == 2
    err = lines(capsys.readouterr().err)
    assert err == [f"error: {store.root}: step 7 is not a committed checkpoint (committed: 1, 2)"]


# ------------------------------------------------------------------------------------------ item 13
def test_export_of_a_run_directory_names_its_checkpoints(tmp_path, capsys):
    commit_step(tmp_path / "runs" / "demo" / "checkpoints")
    assert cli(["export", str(tmp_path / "runs" / "demo"), str(tmp_path / "out")]) == 2
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and "no committed checkpoint" in err[0]
    assert f"its checkpoints are under {tmp_path / 'runs' / 'demo' / 'checkpoints'}" in err[0]


def test_exported_weights_are_readable_like_config_json(tmp_path):
    store = commit_step(tmp_path / "ckpts")
    out = export_policy(store.root, str(tmp_path / "out"))
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_of_a_byte_tokenizer_run_says_its_tokenizer_is_empty(tmp_path, capsys):
    store = commit_step(tmp_path / "ckpts", config={"task": {"name": "x:Y", "options": {"tokenizer": "byte"}}})
    assert cli(["export", store.root, str(tmp_path / "out")]) == 0
    err = [line for line in lines(capsys.readouterr().err) if line.startswith("warning:")]
    assert len(err) == 1, err
    assert "the run used the byte tokenizer" in err[0] and "AutoTokenizer loads an empty one" in err[0]
    assert "--source" in err[0]
