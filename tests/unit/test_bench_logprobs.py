"""`moerl bench logprobs` on CPU: a tiny shape, the torch paths (ours is the torch path there). Checks the report,
not timings."""

from __future__ import annotations

import re

from moerl.bench.logprobs import main


def test_bench_logprobs_reports_each_path(capsys):
    assert main(["--device", "cpu", "--iters", "1", "--warmup", "0", "--entropy", "--temperature", "0.7"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(ours|torch chunked|naive)\s+([\d,.]+)\s", out, re.M))
    assert set(rows) == {"ours", "torch chunked", "naive"}, out
    assert all(float(v.replace(",", "")) > 0 for v in rows.values()), out
    diffs = re.findall(r"^(?:ours|torch chunked|naive)\s.*\s(\S+)$", out, re.M)
    assert all(float(d) < 1e-5 for d in diffs), out  # every path's grad of hidden agrees with ours (float32)
    assert "hw limit" in out and "ours vs torch chunked" in out and "ours vs naive" in out
    assert "liger" not in out  # CUDA only
