"""`moerl bench varlen`: the FLOP count of packed sequences, the rows its table prints (rates against the padded
peer and the model-FLOPs ceiling), and a tiny CPU run. Not timings."""

from __future__ import annotations

import math
import re

import pytest

from moerl.bench import varlen
from moerl.bench.train import active_flops_per_token


def test_packed_flops_count_each_sequences_own_attention():
    c = varlen.make_config(64, 3)
    assert varlen.packed_flops(c, [10, 10]) == pytest.approx(20 * active_flops_per_token(c, 10))
    # attention grows with each sequence's own length: one of 30 costs more than 10 + 20 apart
    apart, together = varlen.packed_flops(c, [10, 20]), varlen.packed_flops(c, [30])
    per_pair = c.num_hidden_layers * 3 * 2 * 2 * c.num_attention_heads * c.head_dim / 2  # 3 x attention per position
    assert together - apart == pytest.approx(per_pair * (30 * 30 - 10 * 10 - 20 * 20))


def test_rows_rate_each_packed_mode_against_the_padded_peer():
    results = {"packed": (0.5, 2.0), "packed, checkpointing": None, "padded": (1.0, 4.0)}
    rows = varlen.rows(results, tokens=1000, flops=1e6, peak=1e9)
    rate = {r.metric: r for r in rows}
    assert rate["tokens/s, packed"].ours == 2000 and rate["tokens/s, packed"].peer == 1000
    assert rate["tokens/s, packed"].ceiling == pytest.approx(1e6)  # 1,000 tokens of 1e6 FLOPs at 1e9 FLOP/s: 1 ms
    assert math.isnan(rate["tokens/s, packed, checkpointing"].ours)  # out of memory: no figure
    assert rate["peak memory, packed"].ours == 2.0 and not rate["peak memory, packed"].higher_is_better
    assert "peak memory, packed, checkpointing" not in rate


def test_tiny_cpu_run_prints_each_mode_and_the_table(capsys, monkeypatch):
    monkeypatch.setattr(varlen, "measure_matmul_peak", lambda device, dtype: 1e11)
    assert varlen.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "packed attention path: SDPA fallback" in out
    assert re.search(r"^padded \[6, \d+\], causal SDPA\s+[\d.]+", out, re.M), out
    assert re.search(r"^tokens/s, packed, SDPA fallback\s.*x\s+[\d.]+%", out, re.M), out
