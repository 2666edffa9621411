"""Bad checkpoints, configs and inputs: a CheckpointError / ValueError whose message names the problem.

Never a bare KeyError, a safetensors error or a torch shape error from deep inside the loader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moerl.ep import BackendUnavailable, make_dispatcher
from moerl.ep.dispatcher import Dispatcher, LocalDispatcher
from moerl.model import CheckpointError, MoEModelConfig, build_model, load_pretrained, read_config, save_pretrained
from moerl.model.moe import SparseMoEBlock

ARCH = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good")
    save_pretrained(build_model(MoEModelConfig(**ARCH), seed=0), path)
    return path


@pytest.fixture
def ckpt(good_checkpoint, tmp_path) -> Path:
    """A fresh, writable copy of a valid single-file checkpoint."""
    dst = tmp_path / "ckpt"
    shutil.copytree(good_checkpoint, dst)
    return dst


def rewrite_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def edit_config(path: Path, **changes) -> None:
    d = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    (path / "config.json").write_text(json.dumps(d))


def test_good_checkpoint_loads(ckpt):
    assert load_pretrained(ckpt).config.num_experts == 4


# ---------------------------------------------------------------------------------------------------
# Tensors


@pytest.mark.parametrize("key", ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"])
def test_missing_tensor_is_named(ckpt, key):
    rewrite_tensors(ckpt, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing keys") as err:
        load_pretrained(ckpt)
    assert key in str(err.value) and str(ckpt) in str(err.value)


def test_missing_expert_tensor_is_named(ckpt):
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    rewrite_tensors(ckpt, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing") as err:
        load_pretrained(ckpt)
    assert key in str(err.value)


def test_missing_router_is_named(ckpt):
    rewrite_tensors(ckpt, lambda t: t.pop("model.layers.0.mlp.gate.weight"))
    with pytest.raises(CheckpointError, match=r"missing keys: model\.layers\.0\.mlp\.gate\.weight"):
        load_pretrained(ckpt)


def test_extra_tensor_is_named(ckpt):
    rewrite_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary.inv_freq": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys: model\.layers\.0\.self_attn\.rotary\.inv_freq"):
        load_pretrained(ckpt)


def test_expert_past_num_experts_is_unexpected(ckpt):
    key = "model.layers.0.mlp.experts.4.gate_proj.weight"  # config.json says 4 experts (0..3)
    rewrite_tensors(ckpt, lambda t: t.update({key: torch.zeros(16, 32)}))
    with pytest.raises(CheckpointError, match="unexpected keys") as err:
        load_pretrained(ckpt)
    assert key in str(err.value)


@pytest.mark.parametrize(
    "key, bad_shape, good_shape",
    [
        ("model.layers.0.self_attn.k_proj.weight", (8, 32), [16, 32]),
        ("model.embed_tokens.weight", (65, 32), [64, 32]),
        ("model.layers.1.mlp.experts.3.gate_proj.weight", (17, 32), [16, 32]),
        ("model.layers.0.mlp.experts.0.down_proj.weight", (16, 32), [32, 16]),
        ("model.layers.0.mlp.experts.1.up_proj.weight", (16,), [16, 32]),
    ],
)
def test_wrong_shape_names_key_and_both_shapes(ckpt, key, bad_shape, good_shape):
    rewrite_tensors(ckpt, lambda t: t.update({key: torch.zeros(bad_shape)}))
    with pytest.raises(CheckpointError) as err:
        load_pretrained(ckpt)
    msg = str(err.value)
    assert repr(key) in msg and str(list(bad_shape)) in msg and str(good_shape) in msg, msg


def test_wrong_shape_in_fused_layout_names_key_and_shapes(ckpt):
    def fuse_badly(t):
        for e in range(4):
            for w in ("gate_proj", "up_proj", "down_proj"):
                t.pop(f"model.layers.0.mlp.experts.{e}.{w}.weight")
        t["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 32, 32)
        t["model.layers.0.mlp.experts.down_proj"] = torch.zeros(3, 32, 16)  # one expert short

    rewrite_tensors(ckpt, fuse_badly)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.down_proj' has shape \[3, 32, 16\].*\[4, 32, 16\]"):
        load_pretrained(ckpt)


def test_no_safetensors_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_pretrained(ckpt)


def test_corrupt_safetensors_file_is_named(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"definitely not safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(ckpt)


# ---------------------------------------------------------------------------------------------------
# Sharded index


@pytest.fixture
def sharded(tmp_path) -> Path:
    save_pretrained(build_model(MoEModelConfig(**ARCH), seed=0), tmp_path, max_shard_bytes=16_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    return tmp_path


def test_index_naming_a_missing_shard(sharded):
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match="do not exist") as err:
        load_pretrained(sharded)
    assert shard.name in str(err.value)


def test_index_that_is_not_json(sharded):
    (sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        load_pretrained(sharded)


def test_index_placing_a_key_in_the_wrong_shard(sharded):
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = next(k for k, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][key] = shards[-1]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_pretrained(sharded)
    assert key in str(err.value) and shards[-1] in str(err.value)


def test_index_missing_a_key(sharded):
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["model.norm.weight"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing keys: model\.norm\.weight"):
        load_pretrained(sharded)


# ---------------------------------------------------------------------------------------------------
# config.json


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(ckpt)


def test_config_json_that_is_not_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "qwen3_moe",')
    with pytest.raises(CheckpointError, match="not valid JSON") as err:
        read_config(ckpt)
    assert "config.json" in str(err.value)


def test_config_json_that_is_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(CheckpointError, match="JSON object"):
        read_config(ckpt)


def test_unsupported_model_type(ckpt):
    edit_config(ckpt, model_type="llama")
    with pytest.raises(CheckpointError, match="'llama' is not supported") as err:
        load_pretrained(ckpt)
    assert "qwen3_moe" in str(err.value)


def test_missing_model_type(ckpt):
    edit_config(ckpt, model_type=None)
    with pytest.raises(CheckpointError, match="model_type None is not supported"):
        read_config(ckpt)


@pytest.mark.parametrize(
    "changes",
    [
        dict(rope_parameters=None, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}),
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
        dict(rope_parameters=None, rope_scaling={"type": "yarn", "factor": 4.0}),
    ],
)
def test_rope_yarn_is_rejected(ckpt, changes):
    edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match="rope_type 'yarn' is not supported"):
        load_pretrained(ckpt)


@pytest.mark.parametrize(
    "changes, pattern",
    [
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(hidden_size=None), r"missing required field\(s\) \['hidden_size'\]"),
        (dict(hidden_size=None, head_dim=None), r"missing required field\(s\) \['hidden_size'\]"),
        (dict(num_attention_heads=None, vocab_size=None), r"missing required field\(s\) \['vocab_size', 'num_attention_heads'\]"),
        (dict(num_key_value_heads=3), "num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
        (dict(head_dim=7), "head_dim=7 must be even"),
        (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"),
    ],
)
def test_bad_config_fields(ckpt, changes, pattern):
    edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match=pattern):
        read_config(ckpt)


def test_config_json_disagreeing_with_tensors(ckpt):
    edit_config(ckpt, moe_intermediate_size=24)
    with pytest.raises(CheckpointError, match=r"has shape \[16, 32\], the config.json implies \[24, 32\]"):
        load_pretrained(ckpt)


# ---------------------------------------------------------------------------------------------------
# Expert parallelism set-up


class MinimalDispatcher(Dispatcher):
    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK):  # pragma: no cover - construction only
        raise NotImplementedError

    def combine(self, y_ND, handle):  # pragma: no cover
        raise NotImplementedError


def test_experts_not_divisible_by_ep_size():
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the expert-parallel size 4"):
        MinimalDispatcher(6, rank=0, world_size=4)
    ok = MinimalDispatcher(8, rank=3, world_size=4)
    assert ok.local_expert_slice == slice(6, 8)


def test_unknown_dispatcher_lists_choices():
    with pytest.raises(BackendUnavailable, match="unknown dispatcher 'nope'") as err:
        make_dispatcher("nope", 8)
    for choice in ("auto", "local", "all_to_all", "symm_mem"):
        assert choice in str(err.value)


def test_dispatcher_for_other_expert_count():
    with pytest.raises(ValueError, match="dispatcher serves 8 experts, the model has 4"):
        SparseMoEBlock(MoEModelConfig(**ARCH), dispatcher=LocalDispatcher(8))


# ---------------------------------------------------------------------------------------------------
# Forward inputs


@pytest.fixture(scope="module")
def model():
    return build_model(MoEModelConfig(**ARCH), seed=0)


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.bool), torch.zeros(5, dtype=torch.long), torch.zeros(1, 2, 5, dtype=torch.long)],
    ids=["float", "bool", "rank1", "rank3"],
)
def test_bad_input_ids(model, bad):
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor \[batch, seq\]") as err:
        model(bad)
    assert str(tuple(bad.shape)) in str(err.value)


def test_int32_input_ids_work(model):
    with torch.no_grad():
        torch.testing.assert_close(model(torch.arange(10).view(2, 5).int()), model(torch.arange(10).view(2, 5)))


def test_routed_experts_of_wrong_shape(model):
    with pytest.raises(ValueError, match=r"\[batch, seq, moe_layers, top_k\] = \[2, 5, 2, 2\], got \[2, 5, 2\]"):
        model.forward_full(torch.zeros(2, 5, dtype=torch.long), routed_experts_BTLK=torch.zeros(2, 5, 2, dtype=torch.long))
