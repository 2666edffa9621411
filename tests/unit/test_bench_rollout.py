"""`moerl bench rollout`: the Qwen3-30B-A3B preset's shape, the HBM floor's byte count, the device-side random
init, and a tiny CPU run that prints the floor and our fraction of it."""

from __future__ import annotations

import pytest
import torch

from moerl.bench import rollout, rollout_workload
from moerl.model.layers import RMSNorm


@pytest.fixture(scope="module")
def params_30b() -> int:
    return rollout_workload.parameter_count(rollout_workload.qwen3_30b_a3b_config())  # counted on the meta device


def test_the_30b_preset_has_qwen3_30b_a3b_shape_and_size(params_30b):
    preset = rollout_workload.PRESETS["qwen3-30b-a3b"]
    c = preset.config()
    assert (c.num_hidden_layers, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.vocab_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        48, 2048, 128, 8, 768, 151_936, 32, 4, 128)
    assert abs(params_30b - 30.53e9) < 0.05e9
    assert (preset.requests, preset.prompt_len, preset.new_tokens, preset.temperature) == (256, 128, 256, 1.0)
    assert preset.dtype == torch.bfloat16 and not preset.peer


def test_floor_bytes_count_every_weight_once_at_a_large_batch(params_30b):
    c = rollout_workload.qwen3_30b_a3b_config()
    weights, kv = rollout.decode_step_bytes(c, batch=256, context=256, bytes_per=2)
    embedding = c.vocab_size * c.hidden_size
    assert abs(weights / 2 - (params_30b - embedding)) < 2e6  # all 128 experts hit, norms aside
    assert kv == 256 * 256 * 48 * 2 * 4 * 128 * 2  # 6.4 GB of bf16 keys and values
    one, _ = rollout.decode_step_bytes(c, batch=1, context=256, bytes_per=2)
    assert one < weights / 8  # one token reads 8 experts of 128 per layer


def test_random_init_drawn_on_the_device():
    c = rollout_workload.PRESETS["tiny"].config()
    model = rollout.random_model(c, torch.bfloat16, torch.device("cpu"), seed=1, draw_on_device=True)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, name
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(bool((w == 1).all()) for w in norms)
    std = model.model.layers[0].mlp.experts.gate_up_proj.detach().float().std()
    assert abs(float(std) - c.initializer_range) < 0.1 * c.initializer_range
    again = rollout.random_model(c, torch.bfloat16, torch.device("cpu"), seed=1, draw_on_device=True)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_tiny_cpu_run_prints_the_floor_and_the_fraction(capsys, monkeypatch):
    monkeypatch.setattr(rollout, "measure_copy_bandwidth", lambda device: 10e9)  # not 3 GB of copies in a test
    assert rollout.main(["--device", "cpu", "--preset", "tiny", "--requests", "2", "--prompt-len", "4",
                         "--new-tokens", "4", "--temperature", "1.0", "--peer", "none"]) == 0
    out = capsys.readouterr().out
    assert "rollout [tiny], temperature 1.0 (peer: none)" in out
    assert "HBM floor (decode)" in out and "% of it" in out
