"""moerl's Qwen3-MoE against transformers' Qwen3MoeForCausalLM: checkpoints both ways, logits, routing.

Every case is a tiny random model (hidden 32-64, 2-4 layers, 4-8 experts) with non-trivial weights
everywhere (norm weights and attention biases too, so a swapped or dropped tensor shows in the logits).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moerl.model import MoEModelConfig, build_model, load_pretrained, read_config, save_pretrained

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter  # noqa: E402

VOCAB = 96

# Field names are shared by MoEModelConfig and Qwen3MoeConfig. moe_intermediate_size and hidden_size
# are multiples of 8 so that grouped_mm (16-byte rows) runs in bf16 too, on both sides.
CASES = [
    pytest.param(
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=40, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             norm_topk_prob=True, tie_word_embeddings=False),
        id="gqa2-normtopk-untied",
    ),
    pytest.param(
        dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=12,
             intermediate_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
             norm_topk_prob=False, tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5),
        id="mqa-nonorm-tied",
    ),
    pytest.param(
        dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
             intermediate_size=48, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
             norm_topk_prob=True, tie_word_embeddings=False, attention_bias=True, mlp_only_layers=[1]),
        id="gqa4-headdim16-bias-mlponly1",
    ),
    pytest.param(
        dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
             intermediate_size=48, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
             norm_topk_prob=False, tie_word_embeddings=True, attention_bias=True, decoder_sparse_step=2),
        id="mha-headdim16-bias-sparsestep2-tied",
    ),
]


def hf_config(arch: dict) -> Qwen3MoeConfig:
    kw = dict(arch)
    theta = kw.pop("rope_theta", 10000.0)
    return Qwen3MoeConfig(
        vocab_size=VOCAB, max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": theta}, **kw
    )


def moerl_config(arch: dict) -> MoEModelConfig:
    return MoEModelConfig(vocab_size=VOCAB, **arch)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, std: float = 0.08) -> None:
    """Seeded non-trivial weights for either implementation (same rule by parameter name)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.05 * noise)
        else:
            p.copy_(std * noise)


def input_ids(seed: int = 0, B: int = 2, T: int = 9) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def moerl_random(arch: dict, seed: int = 1):
    model = build_model(moerl_config(arch), seed=seed)
    randomize_(model, seed)
    return model.eval()


def hf_random(arch: dict, seed: int = 2) -> Qwen3MoeForCausalLM:
    model = Qwen3MoeForCausalLM(hf_config(arch))
    randomize_(model, seed)
    return model.eval()


def assert_clean_loading_info(info: dict) -> None:
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert not info.get("error_msgs"), info


# ---------------------------------------------------------------------------------------------------
# moerl -> transformers


@pytest.mark.parametrize("arch", CASES)
def test_moerl_checkpoint_loads_in_transformers_with_same_logits(arch, tmp_path):
    ours = moerl_random(arch)
    save_pretrained(ours, tmp_path)
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert_clean_loading_info(info)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert hf.dtype == torch.float32
    ids = input_ids()
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert got.shape == ref.shape == (2, 9, VOCAB)
    assert rel_diff(got, ref) < 1e-5


# ---------------------------------------------------------------------------------------------------
# transformers -> moerl


@pytest.mark.parametrize("arch", CASES)
def test_transformers_checkpoint_loads_in_moerl_with_same_logits(arch, tmp_path):
    hf = hf_random(arch)
    # Make sure the routers and experts are really random (not HF's zero-init placeholders).
    for layer in hf.model.layers:
        if hasattr(layer.mlp, "gate"):
            assert layer.mlp.gate.weight.std() > 0.03 and layer.mlp.experts.gate_up_proj.std() > 0.03
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    expected_cfg = moerl_config(arch)
    for field in ("num_experts", "num_experts_per_tok", "head_dim", "norm_topk_prob", "tie_word_embeddings",
                  "mlp_only_layers", "decoder_sparse_step", "attention_bias", "num_key_value_heads", "rope_theta"):
        assert getattr(ours.config, field) == getattr(expected_cfg, field), field
    ids = input_ids(1)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
    assert rel_diff(got, ref) < 1e-5
    if arch["tie_word_embeddings"]:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_round_trip_keeps_every_tensor(tmp_path):
    arch = CASES[2].values[0]
    ours = moerl_random(arch, seed=5)
    save_pretrained(ours, tmp_path)
    back = load_pretrained(tmp_path)
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------------------------
# Sharded and fused checkpoints


def test_moerl_sharded_checkpoint_loads_both_ways(tmp_path):
    arch = CASES[0].values[0]
    ours = moerl_random(arch, seed=3)
    save_pretrained(ours, tmp_path, max_shard_bytes=20_000)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 3 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    ids = input_ids(2)
    with torch.no_grad():
        want = ours(ids)
        hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
        assert_clean_loading_info(info)
        assert rel_diff(hf(ids).logits, want) < 1e-5
        assert torch.equal(load_pretrained(tmp_path)(ids), want)


def test_transformers_sharded_checkpoint_loads_in_moerl(tmp_path):
    arch = CASES[1].values[0]
    hf = hf_random(arch, seed=4)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 3
    ids = input_ids(3)
    with torch.no_grad():
        assert rel_diff(load_pretrained(tmp_path)(ids), hf(ids).logits) < 1e-5


@pytest.mark.parametrize("arch", [CASES[0], CASES[1]])
def test_fused_expert_layout_checkpoint_loads(arch, tmp_path):
    """transformers' in-memory names (experts stacked: gate_up_proj [E, 2I, D]) written straight to disk."""
    hf = hf_random(arch, seed=6)
    state = {k: v.detach().contiguous().clone() for k, v in hf.state_dict().items()}
    if arch["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    ids = input_ids(4)
    with torch.no_grad():
        assert rel_diff(load_pretrained(tmp_path)(ids), hf(ids).logits) < 1e-5


# ---------------------------------------------------------------------------------------------------
# Routing


@pytest.mark.parametrize("arch", [CASES[0], CASES[2], CASES[3]])
def test_routed_experts_match_transformers_router(arch, tmp_path):
    hf = hf_random(arch, seed=7)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    picked = []
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: picked.append(out[2].clone()))
        for m in hf.modules()
        if isinstance(m, Qwen3MoeTopKRouter)
    ]
    ids = input_ids(5, B=3, T=7)
    try:
        with torch.no_grad():
            hf(ids)
            out = ours.forward_full(ids)
    finally:
        for h in hooks:
            h.remove()
    cfg = ours.config
    assert len(picked) == len(cfg.moe_layer_indices) == ours.num_moe_layers
    assert out.routed_experts_BTLK.shape == (3, 7, len(picked), cfg.num_experts_per_tok)
    assert out.routed_experts_BTLK.dtype == torch.int64
    for layer, hf_idx_TK in enumerate(picked):
        assert torch.equal(out.routed_experts_BTLK[:, :, layer].reshape(-1, cfg.num_experts_per_tok), hf_idx_TK)


# ---------------------------------------------------------------------------------------------------
# bf16


@pytest.mark.parametrize("arch", [CASES[0], CASES[2]])
def test_bf16_logits_agree_with_transformers(arch, tmp_path):
    hf32 = hf_random(arch, seed=8)
    hf32.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    # transformers' default experts implementation here (CPU, torch with _grouped_mm) is grouped_mm;
    # moerl's "auto" picks torch._grouped_mm too for bf16 on CPU.
    assert hf.config._experts_implementation == "grouped_mm"
    ours = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert ours.lm_head.weight.dtype == torch.bfloat16
    assert ours.moe_blocks[0].gate.expert_bias.dtype == torch.float32
    ids = input_ids(6)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
        ref32 = hf32(ids).logits
    assert got.dtype == ref.dtype == torch.bfloat16
    assert rel_diff(got, ref) < 2e-2
    # and moerl's bf16 is not much further from the float32 reference than transformers' bf16 is (~1e-2)
    assert rel_diff(got, ref32) < 2 * rel_diff(ref, ref32) + 1e-3


# ---------------------------------------------------------------------------------------------------
# config.json


@pytest.mark.parametrize("arch", CASES)
def test_config_round_trip(arch):
    cfg = moerl_config(arch)
    assert MoEModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # transformers' own config.json (num_local_experts, rope_parameters, no default head_dim) reads the same
    assert MoEModelConfig.from_hf_dict(hf_config(arch).to_dict()) == cfg


def test_partial_config_json_uses_transformers_defaults(tmp_path):
    """Fields a config.json leaves out mean transformers' Qwen3MoeConfig defaults (e.g. norm_topk_prob=False)."""
    d = {"model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
         "intermediate_size": 48}
    (tmp_path / "config.json").write_text(json.dumps(d))
    ours = read_config(tmp_path)
    hf = Qwen3MoeConfig(**{k: v for k, v in d.items() if k != "model_type"})
    for field in ("num_key_value_heads", "norm_topk_prob", "tie_word_embeddings", "attention_bias", "rms_norm_eps",
                  "decoder_sparse_step", "mlp_only_layers", "max_position_embeddings", "router_aux_loss_coef"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.head_dim == 8 and ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.norm_topk_prob is False


def test_saved_config_json_is_loadable_by_transformers(tmp_path):
    arch = CASES[2].values[0]
    save_pretrained(moerl_random(arch), tmp_path)
    raw = json.loads(Path(tmp_path, "config.json").read_text())
    assert raw["model_type"] == "qwen3_moe" and raw["architectures"] == ["Qwen3MoeForCausalLM"]
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    assert cfg.num_experts == 6 and cfg.head_dim == 16 and cfg.mlp_only_layers == [1]
