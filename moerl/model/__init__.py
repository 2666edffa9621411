"""The Qwen3-MoE policy model (Hugging Face weight format), with grouped experts and expert parallelism."""

from moerl.model.build import build_model, init_weights
from moerl.model.config import CheckpointError, MoEModelConfig, tiny_config
from moerl.model.hf import load_pretrained, read_config, read_stop_token_ids, save_pretrained
from moerl.model.moe import is_expert_param
from moerl.model.packing import PackedSeqs
from moerl.model.transformer import CausalLMOutput, MoECausalLM

__all__ = [
    "CausalLMOutput", "CheckpointError", "MoECausalLM", "MoEModelConfig", "build_model", "init_weights",
    "PackedSeqs", "is_expert_param", "load_pretrained", "read_config", "read_stop_token_ids",
    "save_pretrained", "tiny_config",
]
