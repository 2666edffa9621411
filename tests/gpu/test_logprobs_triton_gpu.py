"""The fused (Triton) path of moerl.model.logprobs.chunked_token_logprobs (moerl/kernels/triton_logprobs.py): log-probs,
entropy and both gradients against the float64 full-logits reference, and against the torch chunked path on the
same inputs.

Shape legend: N tokens, D hidden size, V vocabulary.

Cases: V a multiple of the kernels' tile or not (151,936 = 74.2 tiles of 2,048), a V below one tile, several chunks
with a partial last one, tau 1 and 0.7, with and without the entropy, and upstream gradients of both outputs, of
the log-probs only and of the entropy only. Bounds: within TOL_REF of float64 (what bf16 logits allow, as in
test_logprobs_gpu.py), and within float32 rounding of the torch path given the same chunks (hence the same GEMMs):
the statistics to TOL_STATS; the gradients to TOL_GRAD, since grad_l is rounded to bf16 and an ulp's difference in
lse flips the rounding of a few elements. On CUDA the kernel launchers are counted (a run that silently took the
torch path fails). The CPU smoke run (MOERL_GPU_SUITE_ON_CPU=1) runs these kernels too, on CPU tensors with tiny
shapes and a 256-wide tile, when started under TRITON_INTERPRET=1 with triton installed:

    TRITON_INTERPRET=1 MOERL_GPU_SUITE_ON_CPU=1 python -m pytest tests/gpu/test_logprobs_triton_gpu.py -q
"""

from __future__ import annotations

import collections
import importlib.util
import os

import pytest
import torch
from gpu_helpers import rel_err

from moerl.model.logprobs import _fused_chunk_tokens, chunked_token_logprobs, token_logprobs_reference

TOL_REF = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# The entropy's gradient alone, -p (log p + H) / tau, amplifies the bf16 rounding of the logits most (at tau 0.7):
# the torch path's own error against float64 is 1.9e-2 there (V32768x3chunks on the CPU), and the fused path's was
# 2.0e-2 and 2.3e-2 on the H200 (2cb0def). Both paths share those bf16 logits; the bound against the torch path
# below is what checks the kernels.
TOL_REF_ENTROPY_ONLY_BF16 = 3e-2
TOL_STATS = 1e-5
TOL_GRAD = {torch.float32: 1e-5, torch.bfloat16: 1e-3}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# (name, N, D, V, chunk_tokens): chunk None is the fused default (1,766 tokens at V = 151,936 in bf16: 2 chunks)
CUDA_SHAPES = [("V151936", 2048, 1024, 151_936, None), ("V32768x3chunks", 300, 512, 32_768, 128),
               ("V1000", 97, 256, 1000, 40)]
CPU_SHAPES = [("V1000", 37, 16, 1000, 10), ("V512", 21, 16, 512, 8), ("V100", 9, 8, 100, None)]
GRADS = {"both": (True, True), "logp-only": (True, False), "entropy-only": (False, True)}


@pytest.fixture
def launches(device, monkeypatch) -> collections.Counter:
    """Calls of the two kernel launchers. The CPU needs the interpreter (and triton) to run them, and a tile narrower
    than the tiny vocabularies so that rows span several tiles, the last partial."""
    if device.type != "cuda":
        if not (INTERPRET and importlib.util.find_spec("triton")):
            pytest.skip("the CPU runs the Triton kernels only under TRITON_INTERPRET=1 with triton installed")
    import moerl.kernels.triton_logprobs as kernels

    if device.type != "cuda":
        monkeypatch.setattr(kernels, "BLOCK_V", 256)
    calls: collections.Counter = collections.Counter()
    for name in ("logprob_stats", "logprob_grad_"):
        def counted(*args, _fn=getattr(kernels, name), _name=name, **kw):
            calls[_name] += 1
            return _fn(*args, **kw)

        monkeypatch.setattr(kernels, name, counted)
    return calls


@pytest.fixture(autouse=True)
def no_tf32(device, monkeypatch):
    if device.type == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def fwd_bwd(fn, hidden_ND, weight_VD, target_N, g_logp_N, g_ent_N, with_entropy: bool, grads: str, **kw):
    """[logp, entropy (when asked), grad of hidden, grad of weight] for sum(g logp) + sum(e H), either term
    left out as `grads` says (so its upstream gradient arrives as None)."""
    use_g, use_e = GRADS[grads]
    use_e = use_e and with_entropy
    hidden_ND.grad = weight_VD.grad = None
    logp_N, ent_N = fn(hidden_ND, weight_VD, target_N, with_entropy=with_entropy, **kw)
    loss = (logp_N * g_logp_N.to(logp_N.dtype)).sum() if use_g else 0
    if use_e:
        loss = loss + (ent_N * g_ent_N.to(ent_N.dtype)).sum()
    loss.backward()
    return [logp_N.detach(), *([ent_N.detach()] if with_entropy else []), hidden_ND.grad, weight_VD.grad]


def reference(hidden_ND, weight_VD, target_N, *, with_entropy, temperature, **_):
    return token_logprobs_reference(hidden_ND, weight_VD, target_N, with_entropy, temperature)


def inputs(N: int, D: int, V: int, device: torch.device, dtype: torch.dtype, seed: int):
    """hidden, weight (logits ~ N(0, 9), peaky as a trained model's) in dtype, their float64 copies (the same
    rounded values), targets and upstream grads, drawn on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden_ND = torch.randn(N, D, generator=g, device=device).to(dtype)
    weight_VD = (torch.randn(V, D, generator=g, device=device) * (3 / D**0.5)).to(dtype)
    target_N = torch.randint(0, V, (N,), generator=g, device=device)
    target_N[:2] = torch.tensor([0, V - 1], device=device)  # the first and the last column of a row
    g_logp_N, g_ent_N = torch.randn(2, N, generator=g, device=device, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (hidden_ND, weight_VD)]
    leaves64 = [t.double().requires_grad_(True) for t in (hidden_ND, weight_VD)]
    return leaves, leaves64, target_N, g_logp_N, g_ent_N


SHAPES = CUDA_SHAPES if torch.cuda.is_available() else CPU_SHAPES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["tau1", "tau0.7"])
@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("grads", list(GRADS))
def test_fused_logprobs(device, launches, dtype, shape, temperature, with_entropy, grads):
    if grads == "entropy-only" and not with_entropy:
        pytest.skip("no entropy, no gradient of it")
    if dtype == torch.float32 and grads != "both" and device.type == "cuda":
        pytest.skip("float32: both gradients only (bf16 covers the one-sided cases)")
    name, N, D, V, chunk_tokens = shape
    (h, w), (h64, w64), target_N, g_logp_N, g_ent_N = inputs(N, D, V, device, dtype, seed=N + V)
    args = (target_N, g_logp_N, g_ent_N, with_entropy, grads)
    kw = dict(temperature=temperature, chunk_tokens=chunk_tokens)
    got = fwd_bwd(chunked_token_logprobs, h, w, *args, fused=True, **kw)
    assert launches["logprob_stats"] >= 1 and launches["logprob_grad_"] >= 1, dict(launches)
    if device.type == "cuda":  # the default takes the kernels on CUDA, and runs bitwise the same twice
        before = dict(launches)
        again = fwd_bwd(chunked_token_logprobs, h, w, *args, **kw)
        assert all(launches[k] == 2 * n for k, n in before.items()), (before, dict(launches))
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), "not bitwise repeatable"
    # the torch path with the fused path's chunks: the same GEMMs, so only the kernels differ
    chunk = chunk_tokens or _fused_chunk_tokens(V, dtype)
    torch_path = fwd_bwd(chunked_token_logprobs, h, w, *args, fused=False, temperature=temperature,
                         chunk_tokens=chunk)
    want = fwd_bwd(reference, h64, w64, *args, temperature=temperature)
    assert [t.dtype for t in got] == [torch.float32] * (1 + with_entropy) + [dtype, dtype]
    names = ["logp"] + ["entropy"] * with_entropy + ["grad_hidden", "grad_weight"]
    errs_ref = dict(zip(names, (rel_err(a, b) for a, b in zip(got, want, strict=True))))
    errs_torch = dict(zip(names, (rel_err(a, b) for a, b in zip(got, torch_path, strict=True))))
    tol_ref = TOL_REF_ENTROPY_ONLY_BF16 if (grads, dtype) == ("entropy-only", torch.bfloat16) else TOL_REF[dtype]
    assert all(e <= tol_ref for e in errs_ref.values()), f"vs float64: {errs_ref} (NaN fails)"
    bounds = {n: TOL_STATS if n in ("logp", "entropy") else TOL_GRAD[dtype] for n in names}
    assert all(errs_torch[n] <= bounds[n] for n in names), f"vs the torch path: {errs_torch} > {bounds}"


def test_fused_logprobs_empty_and_no_grad(device, launches):
    """No tokens; and no gradient asked of the inputs: the forward alone, equal to the torch path's."""
    (h, w), _, target_N, _, _ = inputs(5, 16, 300, device, torch.float32, seed=7)
    logp_N, ent_N = chunked_token_logprobs(h[:0], w, target_N[:0], with_entropy=True, fused=True)
    assert logp_N.shape == ent_N.shape == (0,)
    with torch.no_grad():
        got = chunked_token_logprobs(h, w, target_N, with_entropy=True, fused=True)
        want = chunked_token_logprobs(h, w, target_N, with_entropy=True, fused=False)
    assert all(rel_err(a, b) <= TOL_STATS for a, b in zip(got, want, strict=True))
