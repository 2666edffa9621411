"""Trainer state through torch.distributed.checkpoint on a local directory (single process, no process group):
bitwise round trips, async == sync, incompatible checkpoints refused before anything changes, export.

The S3 and multi-rank (expert-parallel) variants are in tests/integration/test_checkpoint_s3.py, which reuses
the helpers here.
"""

from __future__ import annotations

import json
import os
import pickle
import zlib
from concurrent import futures

import pytest
import torch
import torch.distributed as dist

from moerl.checkpoint import (
    CheckpointError, CheckpointStore, export_policy, load_trainer_state, save_trainer_state, trainer_state_dict,
    write_arch,
)
from moerl.model import build_model, tiny_config
from moerl.train.loss import LossConfig
from moerl.train.parallel import full_tensor, trainer_groups
from moerl.train.trainer import OptimConfig, PolicyTrainer, Sample


# ------------------------------------------------------------------------------------------ helpers
def make_trainer(seed: int = 0, group=None, ep: bool = False, bias_rate: float = 1e-3, compute_dtype=None,
                 **arch) -> PolicyTrainer:
    groups = trainer_groups(dist.get_world_size() if ep else 1, "cpu") if group is not None else None
    model = build_model(tiny_config(**arch), seed=seed, expert_parallel_group=groups.ep if groups else None,
                        dispatcher="all_to_all" if ep else "local")
    return PolicyTrainer(model, OptimConfig(lr=1e-3, warmup_steps=4, weight_decay=0.01), LossConfig(),
                         groups=groups, expert_bias_rate=bias_rate, compute_dtype=compute_dtype)


def train_step(trainer: PolicyTrainer, seed: int, rank: int = 0) -> dict:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    vocab = trainer.model.config.vocab_size
    samples = [Sample(torch.randint(0, vocab, (5,), generator=g).tolist(), torch.randint(0, vocab, (4,), generator=g).tolist(),
                      (-torch.rand(4, generator=g)).tolist(), 1.0 if i % 2 else -1.0) for i in range(4)]
    return trainer.rl_step(samples)


def snapshot(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """Every tensor of the trainer's state (model, AdamW, scheduler/groups/steps as JSON bytes, RNG), cloned;
    FSDP shards gathered whole (a collective: every rank calls it)."""
    return {k: full_tensor(v.detach()).clone() for k, v in trainer_state_dict(trainer).items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, f"not bitwise equal: {differ[:5]}"


def trained(steps: int = 2, **kw) -> PolicyTrainer:
    tr = make_trainer(**kw)
    for s in range(steps):
        train_step(tr, s)
    return tr


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_round_trip_is_bitwise_and_training_continues_identically(tmp_path, compute_dtype):
    """Also under bf16 compute: the checkpoint holds the float32 master weights and AdamW state."""
    tr = trained(steps=2, compute_dtype=compute_dtype)
    ref = snapshot(tr)
    assert any(k.startswith("optim/") and k.endswith("/exp_avg_sq") for k in ref)
    assert all(v.dtype == torch.float32 for k, v in ref.items() if k.startswith(("model/", "optim/"))
               and v.is_floating_point())
    save_trainer_state(tr, str(tmp_path / "ck"), use_async=False)
    after_save = torch.rand(3)  # the global RNG moves on after the save
    fresh = make_trainer(seed=7, compute_dtype=compute_dtype)  # other weights, empty AdamW state, step 0
    load_trainer_state(fresh, str(tmp_path / "ck"))
    assert_same(snapshot(fresh), ref)
    assert fresh.steps_done == 2 and fresh.scheduler.state_dict() == tr.scheduler.state_dict()
    assert [b.gate.bias_enabled for b in fresh.model.moe_blocks] == [True] * fresh.model.num_moe_layers
    assert torch.equal(torch.rand(3), after_save)  # RNG restored to the saved state
    m1, m2 = train_step(tr, 5), train_step(fresh, 5)
    assert m1["grad_norm"] == m2["grad_norm"] and m1["lr"] == m2["lr"]
    assert_same({k: v for k, v in snapshot(tr).items() if not k.startswith("rng/")},
                {k: v for k, v in snapshot(fresh).items() if not k.startswith("rng/")})


def test_async_save_equals_sync_save_and_is_isolated_from_later_steps(tmp_path):
    tr = trained(steps=1)
    ref = snapshot(tr)
    save_trainer_state(tr, str(tmp_path / "sync"), use_async=False)
    fut = save_trainer_state(tr, str(tmp_path / "async"), use_async=True)
    train_step(tr, 9)  # training goes on while the upload runs: the checkpoint must not see it
    fut.result()
    a, b = make_trainer(seed=3), make_trainer(seed=4)
    load_trainer_state(a, str(tmp_path / "sync"))
    load_trainer_state(b, str(tmp_path / "async"))
    assert_same(snapshot(a), ref)
    assert_same(snapshot(b), ref)


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("arch, needle", [
    ({"num_experts": 4}, r"'model/model\.layers\.0\.mlp\.gate\.weight' is \[8, 64\] .* \[4, 64\]"),
    ({"hidden_size": 32, "head_dim": 8}, r"is \[256, 64\] torch\.float32 in the checkpoint, \[256, 32\]"),
    ({"num_hidden_layers": 1}, r"tensors this model lacks: model/model\.layers\.1\."),
])
def test_incompatible_architecture_fails_before_changing_anything(tmp_path, arch, needle):
    save_trainer_state(trained(steps=1), str(tmp_path / "ck"), use_async=False)
    other = trained(steps=1, seed=5, **arch)
    before = snapshot(other)
    with pytest.raises(CheckpointError, match=needle):
        load_trainer_state(other, str(tmp_path / "ck"))
    assert_same(snapshot(other), before)


def test_missing_and_forged_metadata_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"no trainer checkpoint \(\.metadata missing\)"):
        load_trainer_state(make_trainer(), str(tmp_path / "nothing"))
    save_trainer_state(trained(steps=1), str(tmp_path / "ck"), use_async=False)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    class Writer:  # a class DCP's modules import or define, but not a metadata data class
        def __reduce__(self):
            from torch.distributed.checkpoint.filesystem import FileSystemWriter
            return (FileSystemWriter, (str(marker),))

    for forged, name in ((Evil(), r"(posix|os)\.system"), (Writer(), r"torch\.distributed\.checkpoint\.filesystem\.FileSystemWriter")):
        (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(forged))
        with pytest.raises(CheckpointError, match=rf"\.metadata: checkpoint \.metadata refers to {name}, which is not allowed"):
            load_trainer_state(make_trainer(), str(tmp_path / "ck"))
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ export
def test_export_loads_in_transformers_with_the_trainers_logits(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from moerl.cli import main as cli

    tr = trained(steps=2, bias_rate=0.0)  # the expert bias is not part of the HF format: keep it off here
    root = str(tmp_path / "ckpts")
    assert cli(["export", root, str(tmp_path / "none")]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
    store = CheckpointStore(root)
    save_trainer_state(tr, f"{store.step_path(2)}/trainer", use_async=False)
    write_arch(store, 2, tr.model.config)
    store.commit(2)
    assert cli(["export", root, str(tmp_path / "hf")]) == 0
    assert "step-00000002" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, tr.model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    tr.model.eval()
    with torch.no_grad():
        ref, got = tr.model(ids), hf(ids).logits
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5
    assert export_policy(root, str(tmp_path / "hf2"), step=2).joinpath("config.json").is_file()


def test_export_writes_the_runs_compute_dtype_unless_told(tmp_path):
    from safetensors import safe_open

    tr = trained(steps=1, bias_rate=0.0, compute_dtype=torch.bfloat16)
    store = CheckpointStore(str(tmp_path / "ckpts"))
    save_trainer_state(tr, f"{store.step_path(1)}/trainer", use_async=False)
    write_arch(store, 1, tr.model.config, dtype="bfloat16")  # the run's model.dtype
    store.commit(1)

    def dtypes(out: str) -> set:
        path = export_policy(store.root, str(tmp_path / out), dtype=None if out == "default" else out)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes("default") == {torch.bfloat16}
    assert dtypes("float32") == {torch.float32}  # the float32 master weights, as trained
    with pytest.raises(CheckpointError, match="export dtype must be one of"):
        export_policy(store.root, str(tmp_path / "x"), dtype="float16")


def _chat_model_dir(directory) -> dict:
    """A source model's serving files: a chat tokenizer (save_pretrained's files) and generation_config.json."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>", "user", "assistant", "hello"]
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    raw.add_special_tokens(words[:3])
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<pad>",
                                         unk_token="<unk>", chat_template=template).save_pretrained(directory)
    generation = {"eos_token_id": [2, 0], "pad_token_id": 0, "temperature": 0.6, "top_p": 0.95, "do_sample": True}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return generation


def wait_futures(refs, num_returns=1, timeout=None):
    """ray.wait(refs, num_returns=len(refs)) over the concurrent Futures that _InProcessGroup.save_done returns."""
    done, _ = futures.wait(refs, timeout=timeout)
    return [f for f in refs if f in done], [f for f in refs if f not in done]


def futures_as_ray_refs(mp: pytest.MonkeyPatch) -> None:
    """The checkpointer's ray.get / ray.wait read the concurrent Futures of _InProcessGroup.save_done."""
    from moerl.actors import checkpointer

    mp.setattr(checkpointer.ray, "get", lambda refs, timeout=None: [f.result() for f in refs])
    mp.setattr(checkpointer.ray, "wait", wait_futures)


class _InProcessGroup:
    """What Checkpointer.save drives (RayTrainerGroup.save_state / save_done), on one in-process trainer."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer, self.futures = trainer, []

    def save_state(self, path: str, use_async: bool, target=None) -> None:
        self.futures = [save_trainer_state(self.trainer, path, use_async=use_async,
                                           before_write=target.begin if target is not None else None)]

    def save_done(self) -> list:
        return self.futures


def test_export_serves_with_the_source_models_tokenizer_and_generation_config(tmp_path, monkeypatch, caplog):
    """The run's tokenizer files and generation_config.json travel with each checkpoint; the exported directory
    loads in AutoTokenizer (chat template included) and AutoModelForCausalLM (with the generation config)."""
    transformers = pytest.importorskip("transformers")
    from moerl.actors import checkpointer
    from moerl.checkpoint import serving_files
    from moerl.cli import main as cli

    source = tmp_path / "model"
    source.mkdir()
    generation = _chat_model_dir(source)
    futures_as_ray_refs(monkeypatch)
    tr = trained(steps=1, bias_rate=0.0, vocab_size=7, eos_token_id=2, pad_token_id=0)
    files = serving_files("", str(source))  # model.path empty (random init), the task's tokenizer directory
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(files)
    ckpt = checkpointer.Checkpointer(str(tmp_path / "ckpts"), keep=2, arch=tr.model.config, fingerprint={},
                                     use_async=False, serving_files=files)
    ckpt.save(1, _InProcessGroup(tr), {"steps": 1})
    assert ckpt.latest() == 1 and "hf/tokenizer.json" in ckpt.store.verify(1)["files"]

    out = export_policy(ckpt.store.root, str(tmp_path / "hf"))
    for name in files:
        assert (out / name).read_bytes() == (source / name).read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    original = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
    messages = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == \
        original.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == [1, 4, 6, 2, 1, 5]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == generation["eos_token_id"]
    assert model.generation_config.temperature == generation["temperature"]
    ids = torch.tensor([tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)])
    tr.model.eval()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, tr.model(ids), atol=1e-5)

    bare = CheckpointStore(str(tmp_path / "bare"))  # a checkpoint without them (byte tokenizer, or an older one)
    save_trainer_state(tr, f"{bare.step_path(1)}/trainer", use_async=False)
    write_arch(bare, 1, tr.model.config)
    bare.commit(1)
    with caplog.at_level("WARNING", logger="moerl.checkpoint.export"):
        assert not any(n in (p.name for p in export_policy(bare.root, str(tmp_path / "bare_hf")).iterdir())
                       for n in files)
    assert "no tokenizer files in the checkpoint" in caplog.text and "--source MODEL_OR_TOKENIZER_DIR" in caplog.text
    assert cli(["export", bare.root, str(tmp_path / "sourced"), "--source", str(source)]) == 0
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "sourced", local_files_only=True).chat_template
    assert (tmp_path / "sourced" / "generation_config.json").is_file()
    assert cli(["export", bare.root, str(tmp_path / "x"), "--source", str(tmp_path / "nope")]) == 2


def _forge(ck, key: str, marker, *, bytes_entry: bool = True, path: str = "evil.distcp") -> None:
    """Rewrite the checkpoint's .metadata: `key` becomes a "bytes" entry (dressed with a tensor's size and
    properties, which pickle lets a forger set) stored at `path`, where a pickle that touches `marker` waits."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from moerl.checkpoint.trainer_state import _MetadataUnpickler

    with open(ck / ".metadata", "rb") as f:
        meta = _MetadataUnpickler(f).load()
    good = meta.state_dict_metadata[key]
    if bytes_entry:
        bad = BytesStorageMetadata()
        bad.__dict__.update(size=good.size, properties=good.properties, chunks=good.chunks)
        meta.state_dict_metadata[key] = bad

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    payload = pickle.dumps(Evil())
    (ck / "evil.distcp").write_bytes(payload)
    meta.storage_data = {i: v for i, v in meta.storage_data.items() if i.fqn != key}
    meta.storage_data[MetadataIndex(key) if bytes_entry else MetadataIndex(key, (0,) * len(good.size))] = \
        _StorageInfo(path, 0, len(payload))
    (ck / ".metadata").write_bytes(pickle.dumps(meta))


def reseal(store: CheckpointStore, step: int) -> None:
    """What a forger does after editing a committed local step: rewrite its COMMIT to match the files."""
    base = store.step_path(step)
    manifest = json.loads(open(os.path.join(base, "COMMIT")).read())
    files = {}
    for directory, _, names in os.walk(base):
        for n in names:
            path = os.path.join(directory, n)
            if n != "COMMIT":
                files[os.path.relpath(path, base)] = open(path, "rb").read()
    manifest["files"] = {k: len(v) for k, v in files.items()}
    manifest["checksums"] = {k: f"crc32:{zlib.crc32(v):08x}" for k, v in files.items()}
    with open(os.path.join(base, "COMMIT"), "w") as f:
        f.write(json.dumps(manifest))


@pytest.mark.parametrize("key", ["json/trainer", "model/model.embed_tokens.weight"])
def test_a_forged_bytes_entry_never_reaches_a_pickle_loader(tmp_path, key):
    """DCP reads "bytes" entries with torch.load(weights_only=False): a forged one ran its payload on resume and
    in export. Only tensor entries are admitted now, by exact type."""
    tr = trained(steps=1, bias_rate=0.0)
    store = CheckpointStore(str(tmp_path / "ckpts"))
    save_trainer_state(tr, f"{store.step_path(1)}/trainer", use_async=False)
    write_arch(store, 1, tr.model.config)
    store.commit(1)
    ck = tmp_path / "ckpts" / "step-00000001" / "trainer"
    marker = tmp_path / "pwned"
    _forge(ck, key, marker)
    reseal(store, 1)  # the forger rewrites the manifest too (sizes and CRCs: no signature)
    with pytest.raises(CheckpointError, match=rf"entry '{key}' is a BytesStorageMetadata, not a tensor"):
        load_trainer_state(make_trainer(bias_rate=0.0), str(ck))
    with pytest.raises(CheckpointError, match="not a tensor"):
        export_policy(store.root, str(tmp_path / "hf"))
    assert not marker.exists()


@pytest.mark.parametrize("path", ["../outside.distcp", "/etc/passwd", "s3://elsewhere/x", "a/../../b", ""])
def test_storage_paths_must_stay_inside_the_checkpoint(tmp_path, path):
    save_trainer_state(trained(steps=1), str(tmp_path / "ck"), use_async=False)
    _forge(tmp_path / "ck", "model/model.norm.weight", tmp_path / "pwned", bytes_entry=False, path=path)
    with pytest.raises(CheckpointError, match="is not a plain path inside the checkpoint"):
        load_trainer_state(make_trainer(), str(tmp_path / "ck"))


# ------------------------------------------------------------------------------------------ integrity
class _LocalTrainer:
    """What Checkpointer.restore drives (RayTrainerGroup.load_state), on one in-process trainer."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer = trainer

    def load_state(self, path: str, timeout_s: float = 60.0) -> int:
        load_trainer_state(self.trainer, path, timeout_s)
        return self.trainer.steps_done


def _committed(tmp_path, use_async: bool = True):
    """A step written the way Checkpointer writes one: trainer checksums from the save's future."""
    from moerl.actors.checkpointer import Checkpointer
    from moerl.checkpoint import CONTROLLER_FILE, encode_controller_state
    from moerl.loop.types import STATE_CLASSES

    tr = trained(steps=1, bias_rate=0.0)
    ckpt = Checkpointer(str(tmp_path / "ckpts"), keep=2, arch=tr.model.config, fingerprint={})
    store = ckpt.store
    store.begin(1)
    fut = save_trainer_state(tr, f"{store.step_path(1)}/trainer", use_async=use_async)
    store.write_bytes(1, CONTROLLER_FILE, encode_controller_state({"steps": 1}, classes=STATE_CLASSES))
    write_arch(store, 1, tr.model.config)
    manifest = store.commit(1, checksums={f"trainer/{k}": v for k, v in fut.result().items()})
    return tr, ckpt, manifest


def test_a_flipped_byte_of_the_same_size_is_refused_by_verify_resume_and_export(tmp_path, caplog):
    """The manifest used to record sizes only: a flipped byte passed verify and export wrote NaNs."""
    with caplog.at_level("WARNING", logger="moerl.checkpoint.storage"):
        tr, ckpt, manifest = _committed(tmp_path)
    assert not caplog.records  # every checksum came from the writers: nothing was read back to hash
    assert set(manifest["checksums"]) == set(manifest["files"])
    ckpt.store.verify(1)
    victim = max((n for n in manifest["files"] if n.endswith(".distcp")), key=manifest["files"].get)
    path = tmp_path / "ckpts" / "step-00000001" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))  # same size
    match = rf"corrupted checkpoint: {victim}: checksum does not match"
    with pytest.raises(CheckpointError, match=match):
        ckpt.store.verify(1)
    with pytest.raises(CheckpointError, match=match):
        ckpt.restore(_LocalTrainer(make_trainer(bias_rate=0.0)))
    with pytest.raises(CheckpointError, match=match):
        export_policy(ckpt.store.root, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_a_manifest_without_checksums_is_refused_by_resume(tmp_path):
    """A manifest without its checksums turned the check off (issue 37 item 7): refused now, by resume as by export
    (tests/unit/test_export_untrusted.py)."""
    tr, ckpt, manifest = _committed(tmp_path, use_async=False)
    commit = tmp_path / "ckpts" / "step-00000001" / "COMMIT"
    old = {k: v for k, v in json.loads(commit.read_text()).items() if k != "checksums"}
    commit.write_text(json.dumps(old))
    with pytest.raises(CheckpointError, match="no 'checksums' table"):
        ckpt.restore(_LocalTrainer(make_trainer(seed=3, bias_rate=0.0)))


def test_commit_hashes_by_reading_back_only_files_it_was_not_given(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path / "ckpts"))
    store.write_bytes(1, "a.bin", b"written here")
    (tmp_path / "ckpts" / "step-00000001" / "b.bin").write_bytes(b"written by someone else")
    with caplog.at_level("WARNING", logger="moerl.checkpoint.storage"):
        sums = store.commit(1)["checksums"]
    assert "while writing b.bin; reading back" in caplog.text and "a.bin" not in caplog.text
    assert sums == {"a.bin": f"crc32:{zlib.crc32(b'written here'):08x}",
                    "b.bin": f"crc32:{zlib.crc32(b'written by someone else'):08x}"}
