"""moerl.model.logprobs.chunked_token_logprobs on the device: log-probs, entropy and both gradients against the
naive full-logits computation in float64, in float32 and bf16; and its peak extra memory at a trainer's size.
Timings against the naive computation and Liger: `moerl bench logprobs`.

Shape legend: N tokens, D hidden size, V vocabulary.

The float64 reference sees the same rounded inputs as the chunked call: the bounds measure compute error, not
input rounding. The outputs are allocated inside the autograd Function (nothing to poison); each
parametrization draws its own inputs.
"""

from __future__ import annotations

import gc

import pytest
import torch
from gpu_helpers import rel_err

from moerl.model.logprobs import chunked_token_logprobs
from moerl.model.logprobs import token_logprobs_reference as naive  # what the trainer did before

# The bounds of the former scripts/gpu/logprobs_check.py. bf16: the logits come out of a bf16 GEMM and grad_z is
# rounded to bf16 for the tensor-core GEMMs, ~1e-2 on the grads at tau = 0.7 (the naive bf16 computation has the
# same error); an H200 saw 1.4e-2 at this size, this machine's CPU 1.3e-2.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
MEMORY_TARGET_GIB = 2.0


@pytest.fixture(autouse=True)
def no_tf32(device, monkeypatch):
    """float32 bounds mean float32 GEMMs, whatever an earlier test set."""
    if device.type == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def chunked(hidden_ND, weight_VD, target_N, with_entropy, **kw):
    return chunked_token_logprobs(hidden_ND, weight_VD, target_N, with_entropy=with_entropy, **kw)


def fwd_bwd(fn, hidden_ND, weight_VD, target_N, g_logp_N, g_ent_N, with_entropy: bool, **kw) -> list[torch.Tensor]:
    """[logp, entropy (when asked), grad of hidden, grad of weight] for the loss sum(g * logp) + sum(e * H)."""
    hidden_ND.grad = weight_VD.grad = None
    logp_N, ent_N = fn(hidden_ND, weight_VD, target_N, with_entropy, **kw)
    loss = (logp_N * g_logp_N.to(logp_N.dtype)).sum()
    if with_entropy:
        loss = loss + (ent_N * g_ent_N.to(ent_N.dtype)).sum()
    loss.backward()
    return [logp_N.detach(), *([ent_N.detach()] if with_entropy else []), hidden_ND.grad, weight_VD.grad]


def inputs(N: int, D: int, V: int, device: torch.device, seed: int):
    """float64 hidden, weight (logits ~ N(0, 9): peaky, as a trained model's), targets, upstream grads: drawn on
    the device (a [V, D] float64 draw on the host would take seconds)."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden_ND = torch.randn(N, D, generator=g, dtype=torch.float64, device=device)
    weight_VD = torch.randn(V, D, generator=g, dtype=torch.float64, device=device) * (3 / D**0.5)
    target_N = torch.randint(0, V, (N,), generator=g, device=device)
    g_logp_N, g_ent_N = torch.randn(2, N, generator=g, dtype=torch.float64, device=device)
    return hidden_ND, weight_VD, target_N, g_logp_N, g_ent_N


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["tau1", "tau0.7"])
@pytest.mark.parametrize("with_entropy", [True, False], ids=["entropy", "no-entropy"])
def test_chunked_logprobs_match_float64(device, dtype, temperature, with_entropy):
    """Log-probs, entropy and the gradients of hidden and weight within TOL of float64, over several chunks (the
    default 441 tokens at V = 151,936: 2 chunks, the last partial), and bitwise the same when run again."""
    if device.type == "cuda":
        (N, D, V), chunk_tokens = (512, 1024, 151_936), None
    else:
        (N, D, V), chunk_tokens = (64, 32, 1000), 24  # 3 chunks, the last partial
    seed = 10 * (dtype == torch.bfloat16) + 2 * (temperature != 1.0) + with_entropy
    h64, w64, target_N, g_logp_N, g_ent_N = inputs(N, D, V, device, seed)
    h, w = (t.to(dtype).requires_grad_(True) for t in (h64, w64))
    hr, wr = (t.detach().double().requires_grad_(True) for t in (h, w))
    args = (target_N, g_logp_N, g_ent_N, with_entropy)
    got = fwd_bwd(chunked, h, w, *args, temperature=temperature, chunk_tokens=chunk_tokens)
    again = fwd_bwd(chunked, h, w, *args, temperature=temperature, chunk_tokens=chunk_tokens)
    want = fwd_bwd(naive, hr, wr, *args, temperature=temperature)
    assert [t.dtype for t in got] == [torch.float32] * (1 + with_entropy) + [dtype, dtype]
    errs = [rel_err(a, b) for a, b in zip(got, want, strict=True)]
    names = ["logp"] + ["entropy"] * with_entropy + ["grad_hidden", "grad_weight"]
    assert all(e <= TOL[dtype] for e in errs), f"rel. errors {dict(zip(names, errs))} (NaN fails)"
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), "not bitwise repeatable"


@pytest.mark.cuda_only
@pytest.mark.parametrize("with_entropy", [False, True], ids=["no-entropy", "entropy"])
def test_chunked_logprobs_peak_extra_memory(device, with_entropy):
    """Forward + backward at N = 32,768 tokens, D = 1024, V = 151,936 in bf16 (the naive way holds 56-93 GB) takes
    at most 2 GiB above its inputs, the gradients included (an H200 saw 1.39 GiB with and without entropy)."""
    N, D, V = 32_768, 1024, 151_936
    g = torch.Generator(device=device).manual_seed(100 + with_entropy)
    h = torch.randn(N, D, generator=g, device=device).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(V, D, generator=g, device=device) * (3 / D**0.5)).to(torch.bfloat16).requires_grad_(True)
    target_N = torch.randint(0, V, (N,), generator=g, device=device)
    g_logp_N, g_ent_N = torch.randn(2, N, generator=g, device=device)

    def step() -> list[torch.Tensor]:
        try:
            return fwd_bwd(chunked, h, w, target_N, g_logp_N, g_ent_N, with_entropy)
        finally:
            h.grad = w.grad = None

    step()  # warm-up: cuBLAS workspaces and the allocator's first segments are not this function's memory
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    peak_gib = (torch.cuda.max_memory_allocated() - before) / 2**30
    assert all(torch.isfinite(t).all() for t in out)
    assert 0 < peak_gib <= MEMORY_TARGET_GIB, f"{peak_gib:.2f} GiB extra (with_entropy={with_entropy})"
