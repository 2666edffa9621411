"""The architecture of a Qwen3-MoE policy, read from and written to Hugging Face's config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)

# transformers' Qwen3MoeConfig defaults: a config.json that omits a field means these values (not the
# tiny demo defaults of MoEModelConfig), so a partial config.json loads as transformers reads it.
_HF_DEFAULTS: dict[str, Any] = {
    "intermediate_size": 6144,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "initializer_range": 0.02,
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file, key or field."""


@dataclass
class MoEModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128  # dense MLP layers (mlp_only_layers / decoder_sparse_step)
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """HF's rule: sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise CheckpointError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> MoEModelConfig:
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: model_type {model_type!r} is not supported; moerl loads {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("use_sliding_window"):
            raise CheckpointError(f"{source}: use_sliding_window=true is not supported")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(f"{source}: rope_type {rope_type!r} is not supported (only 'default')")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in d]
        if missing:
            raise CheckpointError(f"{source}: missing required field(s) {missing}")
        values: dict[str, Any] = {k: (list(v) if isinstance(v, list) else v) for k, v in _HF_DEFAULTS.items()}
        for f in dataclasses.fields(cls):
            if f.name == "rope_theta":
                theta = rope.get("rope_theta", d.get("rope_theta"))
                if theta is not None:
                    values["rope_theta"] = float(theta)
            elif f.name == "num_experts" and "num_experts" not in d and "num_local_experts" in d:
                values["num_experts"] = d["num_local_experts"]
            elif f.name in d and (d[f.name] is not None or f.name.endswith("token_id")):
                values[f.name] = d[f.name]
        if "head_dim" not in d or d["head_dim"] is None:
            values["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        config = cls(**values)
        config.mlp_only_layers = list(config.mlp_only_layers or [])
        config.validate()
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        theta = d.pop("rope_theta")
        d.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            hidden_act="silu",
            rope_parameters={"rope_type": "default", "rope_theta": theta},
            use_sliding_window=False,
            sliding_window=None,
            attention_dropout=0.0,
        )
        return d


def tiny_config(**overrides: Any) -> MoEModelConfig:
    """A few-hundred-thousand-parameter MoE for the demo and the tests."""
    return MoEModelConfig(**overrides)
