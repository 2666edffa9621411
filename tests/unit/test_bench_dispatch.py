"""`moerl bench dispatch` on CPU: two spawned gloo ranks, tiny shapes. Checks the report, not the timings."""

from __future__ import annotations

import re

import torch

from moerl.bench.dispatch import main

TINY = ["--tokens", "48,8", "--hidden", "32", "--topk", "2", "--experts", "8", "--world-size", "2",
        "--iters", "2", "--warmup", "1", "--device", "cpu", "--timeout", "120"]


def test_bench_dispatch_reports_both_phases(capsys):
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert out.count("dispatch/combine: ") == 2  # one table per token count
    assert "48 tokens/rank x top-2, hidden 32, 8 experts, bf16, world size 2" in out
    assert "all_to_all (gloo)" in out and "shape of the costs only" in out
    rows = re.findall(r"^(all_to_all (dispatch|combine) (latency|bandwidth))\s+([\d.,e+-]+) (ms|GB/s)\s+"
                      r"([\d.,e+-]+) (ms|GB/s)\s+1\.00x", out, flags=re.M)
    assert len(rows) == 8, out  # 2 tables x 2 phases x (latency, bandwidth)
    assert {r[1] for r in rows} == {"dispatch", "combine"}
    for r in rows:
        assert float(r[3].replace(",", "")) > 0 and float(r[5].replace(",", "")) > 0
    if not torch.cuda.is_available():
        assert "symm_mem not measured: CUDA is not available" in out


def test_bench_dispatch_symm_mem_on_cpu_says_why(capsys):
    assert main(TINY + ["--backend", "symm_mem"]) == 2
    assert "symm_mem cannot run here" in capsys.readouterr().out
