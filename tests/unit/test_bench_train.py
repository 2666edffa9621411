"""`moerl bench train` runs end to end on the CPU (tiny shapes) and prints its table with the peer."""

from __future__ import annotations

import pytest

from moerl.bench.train import active_flops_per_token, main
from moerl.model import tiny_config


def test_bench_train_prints_ours_and_the_peer(capsys):
    pytest.importorskip("transformers")
    assert main(["--device", "cpu", "--samples", "2", "--seq", "32", "--prompt", "8", "--vocab", "512",
                 "--steps", "1", "--micro-batch-tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert "2x32 tokens/s" in out and "transformers+AdamW" in out and "MFU" in out
    assert "2x32 ours MFU:" in out and "of the measured matmul peak" in out and "no datasheet peak" in out


def test_mfu_line_names_the_datasheet_peak_and_the_measured_one():
    from moerl.bench.common import mfu_line

    line = mfu_line("128x2048 ours", 300e12, 750e12, (989.5e12, "NVIDIA H200 Tensor Core GPU datasheet"))
    assert line == ("128x2048 ours MFU: 30.3% of the datasheet bf16 peak 990 TFLOP/s (NVIDIA H200 Tensor Core GPU "
                    "datasheet); 40.0% of the measured matmul peak 750 TFLOP/s")


def test_flops_count_active_experts_and_the_head():
    arch = tiny_config(vocab_size=1000, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32)
    attn = 64 * 16 * (2 * 4 + 2 * 2)
    moe = 2 * 3 * 64 * 32 + 64 * 8
    causal = 1 * 2 * 2 * 4 * 16 * 10 / 2
    assert active_flops_per_token(arch, 10) == 6 * (attn + moe + 64 * 1000) + 3 * causal
