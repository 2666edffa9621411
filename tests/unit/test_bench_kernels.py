"""`moerl bench kernels`: the bytes each case must move, the GB/s and fractions its table prints from them, and a
CPU run (ours is the torch reference there) that reports every case bitwise equal. Not timings."""

from __future__ import annotations

import re

import pytest
import torch

from moerl.bench import kernels


def test_norm_bytes_count_each_tensor_once():
    # [4, 8] bf16 rows (64 bytes a tensor), a float32 weight of 8 (32 bytes)
    assert kernels.norm_bytes(4, 8, 2, 4, add=False, train=False) == 2 * 64 + 32  # x in, y out, w
    assert kernels.norm_bytes(4, 8, 2, 4, add=True, train=False) == 4 * 64 + 32  # h, delta in; sum, y out
    assert kernels.norm_bytes(4, 8, 2, 4, add=False, train=True) == (2 + 3) * 64 + 3 * 32  # + dy, x in; dx out
    assert kernels.norm_bytes(4, 8, 2, 4, add=True, train=True) == (4 + 4) * 64 + 3 * 32  # + dy, dsum, sum; dh


def test_router_and_sampler_bytes():
    assert kernels.router_bytes(256, 128, 8, 2) == 256 * 128 * 2 + 256 * 8 * (8 + 2)
    assert kernels.sampler_bytes(2, 10, 4) == 2 * 10 * 4 + 2 * 20 + 2 * 12


def test_rows_give_gb_per_s_the_ratio_and_the_fraction_of_the_copy_bandwidth():
    results = [kernels.Result("a", nbytes=10**9, ours_s=0.5, torch_s=1.0, compiled_s=0.25, equal=1.0),
               kernels.Result("b", nbytes=10**9, ours_s=1.0, torch_s=2.0, compiled_s=None, equal=1.0)]
    torch_rows = kernels.rows(results, copy_bw=4e9, peer="torch")
    assert [(r.metric, r.ours, r.peer, r.ceiling) for r in torch_rows] == [("a", 2.0, 1.0, 4.0), ("b", 1.0, 0.5, 4.0)]
    compiled = kernels.rows(results, copy_bw=4e9, peer="compile")
    assert [(r.metric, r.ours, r.peer) for r in compiled] == [("a", 2.0, 4.0)]  # b did not compile: no row
    table = kernels.format_table("t", torch_rows)
    assert re.search(r"^a\s+2 GB/s\s+1 GB/s\s+2\.00x\s+50\.0%", table, re.M), table


def test_equal_fraction_counts_elements_over_every_output():
    got = (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 2]))
    want = (torch.tensor([1.0, 2.5, 3.0]), torch.tensor([1, 2]))
    assert kernels.equal_fraction(got, want) == pytest.approx(4 / 5)
    assert kernels.equal_fraction((torch.tensor([float("nan")]),), (torch.tensor([float("nan")]),)) == 0.0


def test_cpu_run_reports_every_case(capsys, monkeypatch):
    monkeypatch.setattr(kernels, "measure_copy_bandwidth", lambda device: 10e9)  # not 256 MB of copies in a test
    assert kernels.main(["--device", "cpu", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    names = [c.name for c in kernels.cases(torch.device("cpu"), kernels.GROUPS)]
    assert len(names) == 7
    for name in names:
        line = re.search(rf"^{re.escape(name)}\s+([\d,.]+)\s+([\d,.]+)\s+-\s+([\d,.]+)\s+([\d.]+)\s+-$", out, re.M)
        assert line, (name, out)
        assert float(line.group(4)) == 1.0  # on a CPU ours is the reference: bitwise equal
    assert "ours vs the torch expressions" in out and "torch.compile" not in out.split("hw limit")[1]


def test_the_compile_peer_is_timed_and_compared_like_ours(monkeypatch):
    """torch.compile stood in by the function itself (compiling is CUDA-only in the bench, and slow): its column
    and its bitwise-equal fraction come from the same steps as ours."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    args = kernels._parse(["--device", "cpu", "--reps", "1"])
    for case in kernels.cases(torch.device("cpu"), ("decode", "train")):
        r = kernels.measure(case, torch.device("cpu"), args, compile_peer=True)
        assert r.compiled_s is not None and r.compiled_s > 0 and r.compiled_equal == 1.0 and not r.note, r
