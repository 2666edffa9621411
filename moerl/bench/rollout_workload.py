"""What both rollout benchmarks run: the model shapes and workloads (`PRESETS`) and one engine timed over a
workload (`run_engine`). `moerl bench rollout` (rollout.py) measures one engine against transformers, and with
--ep-size > 1 hands over to rollout_ep.py, which measures an engine group against one engine; both import this.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from moerl.bench.common import synchronize
from moerl.model import MoECausalLM, MoEModelConfig, tiny_config
from moerl.rollout import Engine, SamplingParams


def bench_model_config() -> MoEModelConfig:
    """About 1B parameters: hidden 1024, 16 layers, 64 experts top-8, expert intermediate 256."""
    return MoEModelConfig(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                          num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                          num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True,
                          max_position_embeddings=4096)


def qwen3_30b_a3b_config() -> MoEModelConfig:
    """Qwen3-30B-A3B's shape (its config.json): 48 layers, hidden 2048, 32 query / 4 key-value heads of 128,
    128 experts top-8 of intermediate 768, vocabulary 151,936; 30.5B parameters, 3.3B active per token."""
    return MoEModelConfig(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          rope_theta=1_000_000.0, max_position_embeddings=40_960)


@dataclass(frozen=True)
class Preset:
    """A model shape and the workload run on it."""

    config: Callable[[], MoEModelConfig]
    requests: int
    prompt_len: int
    new_tokens: int
    temperature: float  # 0 = greedy (lets the output be compared with transformers')
    dtype: torch.dtype
    peer: bool  # run transformers generate by default
    note: str = ""


PRESETS = {
    "tiny": Preset(tiny_config, 16, 16, 32, 0.0, torch.float32, True, "the demo model"),
    "0.9b": Preset(bench_model_config, 256, 128, 256, 0.0, torch.bfloat16, True),
    "qwen3-30b-a3b": Preset(qwen3_30b_a3b_config, 256, 128, 256, 1.0, torch.bfloat16, False,
                            "transformers not run by default: a second copy of the 61 GB of weights does not fit"),
}


def parameter_count(config: MoEModelConfig) -> int:
    """Parameters of the model built from `config`, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = MoECausalLM(config)
    return sum(p.numel() for p in model.parameters())


def size_label(n: int) -> str:
    """A parameter count as the tables print it: 30.53B, 8.39M."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def sampling_params(n: int, new_tokens: int, temperature: float) -> list[SamplingParams]:
    """One seed per request: sampled runs are reproducible and every request draws its own noise."""
    return [SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=i) for i in range(n)]


def run_engine(engine: Engine, model, prompts, new_tokens: int, temperature: float) -> dict:
    """Generate new_tokens for every prompt, timed: first tokens, decode throughput after the last first token,
    the tokens themselves (by request) and whether decode ran as CUDA graphs."""
    params = sampling_params(len(prompts), new_tokens, temperature)
    device = next(model.parameters()).device
    synchronize(device)
    t0 = time.perf_counter()
    for p, sp in zip(prompts, params):
        engine.submit(p, sp)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    generated = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now - t0
            generated += len(out.new_token_ids)
            if out.completion is not None:
                tokens[out.request_id] = out.completion.token_ids
    total = time.perf_counter() - t0
    all_first = max(first.values())
    return {"total_s": total, "ttft_s": sum(first.values()) / len(first), "all_first_s": all_first,
            "decode_tok_s": (generated - len(prompts)) / (total - all_first), "generated": generated,
            "decode_steps": engine.stats["decode_steps"],
            "tokens": [tokens[k] for k in sorted(tokens, key=lambda r: int(r.split("-")[1]))],
            "graphs": engine.graphs is not None and engine.graphs.disabled_reason is None}
