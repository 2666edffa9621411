"""`moerl bench paged-decode`: the rows its table prints from step times (rates against the slab peer, the HBM
floor as ceiling), and a tiny eager CPU run. Not timings."""

from __future__ import annotations

import math
import re

import pytest

from moerl.bench import paged_decode


def test_rows_with_graphs_rate_the_kernel_and_the_gather_path_against_the_slab():
    t = {"slab": 0.004, "kernel": 0.002, "gather": 0.008, "step": 0.0025}
    rows = {r.metric: r for r in paged_decode.rows(64, 1024, t, floor_s=0.001)}
    kernel = rows["ctx 1024: decode step, paged kernel"]
    assert (kernel.ours, kernel.peer, kernel.ceiling) == (pytest.approx(32_000), pytest.approx(16_000), 64_000)
    assert rows["ctx 1024: decode step, paged gather + SDPA"].ours == pytest.approx(8_000)
    step = rows["ctx 1024: Engine.step(), host included"]
    assert step.ours == pytest.approx(25_600) and step.peer is None
    table = paged_decode.format_table("t", list(rows.values()))
    assert re.search(r"paged kernel\s+3\.2e\+04 tok/s\s+1\.6e\+04 tok/s\s+2\.00x\s+50\.0%", table), table


def test_rows_without_graphs_give_the_eager_step_alone():
    rows = paged_decode.rows(4, 8, {"slab": 0.002, "kernel": math.nan, "step": 0.004}, floor_s=0.001)
    assert [(r.metric, r.ours, r.peer, r.ceiling) for r in rows] == [("ctx 8: Engine.step(), eager", 1000, 2000, 4000)]


def test_tiny_cpu_run_prints_each_context(capsys, monkeypatch):
    monkeypatch.setattr(paged_decode, "measure_copy_bandwidth", lambda device: 10e9)
    assert paged_decode.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for ctx in (8, 32):
        assert re.search(rf"^context {ctx}: slab [\d.]+ ms, step [\d.]+ ms; floor", out, re.M), out
        assert re.search(rf"^ctx {ctx}: Engine.step\(\), eager\s+[\d.,]+ tok/s\s+[\d.,]+ tok/s\s+[\d.]+x", out, re.M), out
