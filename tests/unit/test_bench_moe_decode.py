"""`moerl bench moe-decode` on CPU: tiny shapes, the fused path's torch reference. Checks the report, not timings."""

from __future__ import annotations

import re

from moerl.bench.moe_decode import main


def test_bench_moe_decode_reports_every_token_count(capsys):
    assert main(["--device", "cpu", "--tokens", "1,5", "--iters", "1", "--warmup", "0", "--peer", "grouped_mm"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+)\s+([\d,.]+)\s+([\d,.]+)\s+([\d,.]+)\s+([\d,.]+) \(grouped_mm, eager\)", out, re.M)
    assert [r[0] for r in rows] == ["1", "5"], out
    assert all(float(v.replace(",", "")) > 0 for r in rows for v in r[1:]), out
    assert "GB/s of touched weights" in out and "copy bandwidth" in out


def test_bench_moe_decode_tune_needs_cuda(capsys):
    assert main(["--device", "cpu", "--tune"]) == 2
    assert "needs CUDA" in capsys.readouterr().out
