"""The torch references behind the fused decode kernels (moerl.kernels.norm, moerl.kernels.router): bitwise what the
model computes (RMSNorm, TopKRouter without replay, their HF originals), gradients included, and the dispatch
taking them wherever the Triton kernels may not run (CPU, autograd). The kernels themselves are checked against
these references in tests/gpu/test_small_kernels_gpu.py.

Shape legend: T tokens, D hidden, E experts, K experts per token.
"""

from __future__ import annotations

import pytest
import torch

from moerl.kernels import norm as norm_mod
from moerl.kernels import router as router_mod
from moerl.kernels.norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from moerl.kernels.router import router_topk, router_topk_reference
from moerl.model.config import MoEModelConfig
from moerl.model.layers import RMSNorm
from moerl.model.moe import TopKRouter

DTYPES = [torch.float32, torch.bfloat16]
# rows of the hidden size (any leading shape) and of head_dim (q_norm/k_norm: [B, T, heads, d])
NORM_SHAPES = [(5, 64), (2, 3, 64), (2, 3, 4, 16)]


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3MoeRMSNorm.forward, written out (so the test needs no transformers)."""
    input_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(input_dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_norm_references_are_the_model_norm_bitwise(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape))
    x, delta = (3 * torch.randn(shape, generator=gen)).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=gen))
        want = hf_rms_norm(x, norm.weight, 1e-6)
        assert torch.equal(rms_norm_reference(x, norm.weight, 1e-6), want)
        assert torch.equal(norm(x), want)
        h_want = x + delta
        for h, y in (add_rms_norm_reference(x, delta, norm.weight, 1e-6), norm.add_and_norm(x, delta)):
            assert torch.equal(h, h_want) and torch.equal(y, hf_rms_norm(h_want, norm.weight, 1e-6))


def test_norm_dispatch_keeps_autograd():
    """With grad enabled the reference runs (the kernels have no backward): gradients reach h, delta and weight,
    bitwise those of the HF expression. (Not gradcheck: the norm computes in float32 even for float64 inputs.)"""
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen), torch.randn(16, generator=gen)]
    grads = []
    for fused in (True, False):
        h, delta, w = (t.clone().requires_grad_(True) for t in leaves)
        if fused:
            s, y = add_rms_norm(h, delta, w, 1e-6)
            y = y + rms_norm(s, w, 1e-6)
        else:
            s = h + delta
            y = hf_rms_norm(s, w, 1e-6) + hf_rms_norm(s, w, 1e-6)
        grads.append(torch.autograd.grad((s * y).sum(), (h, delta, w)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_fused_paths_never_apply_on_cpu_or_under_autograd():
    x, w = torch.randn(3, 8), torch.ones(8)
    logits = torch.randn(3, 8)
    with torch.no_grad():
        assert not norm_mod.fused_norm_applies(x, w) and not router_mod.fused_router_applies(logits, 2)
    if torch.cuda.is_available():  # a GPU host running the unit tests: grad mode alone keeps the reference
        with torch.enable_grad():
            assert not norm_mod.fused_norm_applies(x.cuda(), w.cuda())
            assert not router_mod.fused_router_applies(logits.cuda(), 2)


def router(E: int, K: int, norm_topk_prob: bool, bias: bool, dtype: torch.dtype, seed: int) -> TopKRouter:
    cfg = MoEModelConfig(hidden_size=32, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm_topk_prob)
    gate = TopKRouter(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        gate.weight.normal_(0, 0.3, generator=gen)
        if bias:  # as update_expert_bias leaves it: the flag on, a bias that changes the choice
            gate.bias_enabled = True
            gate.expert_bias.copy_(0.02 * torch.randn(E, generator=gen))
    return gate.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_router_reference_is_topk_router_bitwise(dtype, norm_topk_prob, bias):
    """router_topk_reference on the router's logits = TopKRouter.forward without replay: the same experts in the
    same order, the same weights, and (the edit that routes TopKRouter through router_topk keeps training as it
    is) the same gradients to the input and the router weight."""
    E, K = 16, 4
    gate = router(E, K, norm_topk_prob, bias, dtype, seed=3 + 2 * bias + norm_topk_prob)
    x_TD = torch.randn(23, 32, generator=torch.Generator().manual_seed(7)).to(dtype)
    x1, x2 = x_TD.clone().requires_grad_(True), x_TD.clone().requires_grad_(True)
    out = gate(x1)
    logits_TE = torch.nn.functional.linear(x2, gate.weight)
    idx_TK, w_TK = router_topk_reference(logits_TE, K, norm_topk_prob, gate.expert_bias if bias else None)
    assert idx_TK.dtype == torch.int64 and w_TK.dtype == dtype
    assert torch.equal(idx_TK, out.topk_idx_TK) and torch.equal(w_TK, out.topk_weights_TK)
    grad_TK = torch.randn(w_TK.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    (g_x1, g_w1) = torch.autograd.grad(out.topk_weights_TK, (x1, gate.weight), grad_TK)
    (g_x2, g_w2) = torch.autograd.grad(w_TK, (x2, gate.weight), grad_TK)
    assert torch.equal(g_x1, g_x2) and torch.equal(g_w1, g_w2)
    with torch.no_grad():  # the dispatch on the CPU: the reference
        idx2_TK, w2_TK = router_topk(logits_TE, K, norm_topk_prob, gate.expert_bias if bias else None)
    assert torch.equal(idx2_TK, idx_TK) and torch.equal(w2_TK, w_TK)


def test_router_reference_is_transformers_router():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for norm_topk_prob in (True, False):
        cfg = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                          norm_topk_prob=norm_topk_prob)
        hf = Qwen3MoeTopKRouter(cfg)
        with torch.no_grad():
            hf.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(9))
            x_TD = torch.randn(19, 32, generator=torch.Generator().manual_seed(10))
            logits_TE, weights_TK, idx_TK = hf(x_TD)
            got_idx_TK, got_w_TK = router_topk_reference(logits_TE, 4, norm_topk_prob)
        assert torch.equal(got_idx_TK, idx_TK) and torch.equal(got_w_TK, weights_TK)
