"""The sampler's cheap paths: Gumbel-max with no sort at temperature 1 without filters (RL's decode), top-k over
its candidates only; each matches the general path, the softmax distribution and the batch-independence contract.
The fused Triton kernel is compared with its torch reference under Triton's interpreter where triton is installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moerl.rollout.sampling import SamplingBatch, SamplingParams, sample, sampling_hints

V = 50


def logits_of(B: int, seed: int = 0, scale: float = 1.0, vocab: int = V) -> torch.Tensor:
    return scale * torch.randn(B, vocab, generator=torch.Generator().manual_seed(seed))


def batch_of(params: list[SamplingParams], positions: list[int]) -> SamplingBatch:
    b = SamplingBatch.empty(len(params), "cpu")
    b.set_rows(list(range(len(params))), params, [p.seed for p in params], positions)
    return b


def hints(params: list[SamplingParams]) -> dict:
    return sampling_hints([SimpleNamespace(params=p) for p in params])


def test_hints_pick_the_path():
    plain, top_k, top_p, greedy = (SamplingParams(), SamplingParams(top_k=20), SamplingParams(top_p=0.9),
                                   SamplingParams(temperature=0.0, top_k=3))
    assert hints([greedy]) == {"all_greedy": True, "any_filter": False, "top_k_cap": 0}
    assert hints([plain, greedy]) == {"all_greedy": False, "any_filter": False, "top_k_cap": 0}
    assert hints([top_k, SamplingParams(top_k=5, top_p=0.5), greedy])["top_k_cap"] == 20
    assert hints([top_k, top_p]) == {"all_greedy": False, "any_filter": True, "top_k_cap": 0}
    assert hints([top_k, plain]) == {"all_greedy": False, "any_filter": True, "top_k_cap": 0}


def test_temperature_one_without_filters_never_sorts_and_matches_softmax(monkeypatch):
    """n rows with the same logits and their own seeds: token frequencies vs softmax, chi-square with V - 1
    degrees of freedom (fixed seeds: deterministic). Sorting is forbidden on this path."""
    def no_sort(*a, **k):
        raise AssertionError("the unfiltered path must not sort the vocabulary")
    monkeypatch.setattr(torch, "sort", no_sort)
    monkeypatch.setattr(torch, "topk", no_sort)
    n, logits_V = 6000, logits_of(1)[0]
    params = [SamplingParams(seed=s) for s in range(n)]
    assert not hints(params)["any_filter"]
    tokens, logprobs = sample(logits_V.expand(n, -1), batch_of(params, [9] * n), **hints(params))
    probs = torch.softmax(logits_V, -1)
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)  # the full log-softmax of the token
    expected = n * probs
    assert expected.min() > 5  # the chi-square approximation holds
    chi2 = float(((torch.bincount(tokens, minlength=V) - expected) ** 2 / expected).sum())
    assert chi2 < 85.4  # 99.9% quantile of chi-square with 49 degrees of freedom


def rows_alone_and_reordered(logits_BV, params, positions, **hint):
    tokens, logprobs = sample(logits_BV, batch_of(params, positions), **hint)
    for i in range(len(params)):
        t, lp = sample(logits_BV[i: i + 1], batch_of([params[i]], [positions[i]]), **hints([params[i]]))
        assert int(t) == int(tokens[i]) and torch.allclose(lp, logprobs[i: i + 1], atol=1e-6)
    rev = list(range(len(params) - 1, -1, -1))
    t_rev, _ = sample(logits_BV[rev], batch_of([params[i] for i in rev], [positions[i] for i in rev]), **hint)
    assert torch.equal(t_rev, tokens[rev])
    return tokens, logprobs


def test_same_seed_same_token_in_any_batch_on_the_fast_paths():
    logits = logits_of(12, seed=3, scale=2.0)
    positions = [4 + 3 * i for i in range(12)]
    plain = [SamplingParams(temperature=[1.0, 0.0, 0.7, 1.0][i % 4], seed=77 + i) for i in range(12)]
    tokens, _ = rows_alone_and_reordered(logits, plain, positions, **hints(plain))
    assert len(set(tokens.tolist())) > 5
    capped = [SamplingParams(temperature=[1.0, 0.0, 0.8][i % 3], top_k=[3, 8, 30, 5][i % 4],
                             top_p=[1.0, 0.7][i % 2], seed=5 + i) for i in range(12)]
    assert hints(capped)["top_k_cap"] == 30
    rows_alone_and_reordered(logits, capped, positions, **hints(capped))


def test_fast_paths_give_the_general_paths_tokens_and_logprobs(monkeypatch):
    logits = logits_of(16, seed=4, scale=2.0, vocab=300)
    positions = list(range(16))
    capped = [SamplingParams(temperature=[1.0, 0.5, 0.0, 2.0][i % 4], top_k=[4, 40, 1, 250][i % 4],
                             top_p=[1.0, 0.8, 0.3, 0.95][i % 4], seed=900 + i) for i in range(16)]
    want = sample(logits, batch_of(capped, positions))  # full sort
    sorts = []
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(1) or torch.Tensor.sort(*a, **k))
    got = sample(logits, batch_of(capped, positions), **hints(capped))
    assert not sorts  # only the top-250 candidates were ranked (by topk)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], atol=1e-6)
    plain = [SamplingParams(temperature=[1.0, 0.0, 1.5][i % 3], seed=40 + i) for i in range(16)]
    want = sample(logits, batch_of(plain, positions))
    got = sample(logits, batch_of(plain, positions), **hints(plain))
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1], atol=1e-6)


_INTERPRETED = """
import sys, torch
sys.path.insert(0, {root!r})
from moerl.kernels.triton_sampling import gumbel_argmax_triton
from moerl.rollout.sampling import SamplingBatch, SamplingParams, gumbel_argmax_reference, noise_key
B = 8
for V, dtype in ((4099, torch.bfloat16), (37, torch.float32)):
    logits = (3 * torch.randn(B, 2, V, generator=torch.Generator().manual_seed(V))).to(dtype)[:, -1]
    params = [SamplingParams(temperature=[1.0, 0.0, 0.7][i % 3], seed=100 + i) for i in range(B)]
    b = SamplingBatch.empty(B, "cpu")
    b.set_rows(list(range(B)), params, [p.seed for p in params], [5 + i for i in range(B)])
    tok, lp = gumbel_argmax_triton(logits, b.temperature_B, noise_key(b.seed_B, b.position_B))
    ref_tok, ref_lp = gumbel_argmax_reference(logits, b)
    assert tok.tolist() == ref_tok.tolist(), (tok, ref_tok)
    assert (lp - ref_lp).abs().max() < 1e-5
flat = torch.zeros(3, 2500)  # greedy ties: the first token, as torch.argmax
tok, lp = gumbel_argmax_triton(flat, torch.zeros(3), torch.arange(3))
assert tok.tolist() == [0, 0, 0] and torch.allclose(lp, torch.full((3,), -float(torch.tensor(2500.).log())))
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_sampler_matches_the_reference_in_the_interpreter():
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERPRETED.format(root=root)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_a_fused_sampler_that_fails_or_disagrees_falls_back_to_the_reference(monkeypatch, caplog):
    """The Triton sampler is checked once per device and dtype against the reference before it samples: one that
    raises (e.g. fails to compile) or returns other tokens is not used."""
    import sys
    import types

    from moerl.rollout import sampling

    def wrong(logits_BV, temperature_B, key_B):
        return torch.zeros(logits_BV.shape[0], dtype=torch.long), torch.zeros(logits_BV.shape[0])

    def broken(*args):
        raise RuntimeError("PTX compile error")

    for fake, message in ((wrong, "disagrees"), (broken, "PTX compile error")):
        monkeypatch.setitem(sys.modules, "moerl.kernels.triton_sampling",
                            types.SimpleNamespace(gumbel_argmax_triton=fake))
        sampling.fused_sampler_ok.cache_clear()
        with caplog.at_level("WARNING"):
            assert not sampling.fused_sampler_ok(torch.device("cpu"), torch.float32)
        assert message in caplog.text
    sampling.fused_sampler_ok.cache_clear()
