"""The Triton MoE kernels (moerl/kernels/triton_moe.py, reached through moerl.kernels and moerl.ep.permute) and the
fused Gumbel-max sampler (moerl/kernels/triton_sampling.py) against their references.

Shape legend: T tokens, K slots per token, N kept (token, slot) rows, D hidden, I expert intermediate, B rows,
V vocabulary.

Each MoE op runs forward and backward in float32 and bf16 on the device and is compared with the torch path in
float64 on the same unrounded inputs and upstream gradient, by ||got - want|| / ||want||. On CUDA the Triton
wrappers are counted, so a check that silently took the torch path (no triton) fails instead of passing; the CPU
smoke run (tiny shapes) runs the same code on the torch path. The kernels allocate their own outputs (nothing to
poison); every parametrization draws its own inputs, so a row a kernel skipped cannot hold a stale right answer.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from gpu_helpers import rel_err

import moerl.kernels as kernels
from moerl.ep.permute import combine_weighted, expand_tokens
from moerl.kernels import swiglu
from moerl.model.config import MoEModelConfig
from moerl.model.moe import SparseMoEBlock, grouped_mm_available
from moerl.rollout.sampling import SamplingBatch, SamplingParams, gumbel_argmax_reference, noise_key

# The former scripts/gpu/kernels_check.py's bounds; on an H200 float32 was <= 6e-7 and bf16 <= 7e-3 (BENCHMARKS.md)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
LOW_PRECISION = [torch.float32, torch.bfloat16]
TRITON_WRAPPERS = ("gather_weighted_sum", "combine_backward", "swiglu_forward", "swiglu_backward")


@pytest.fixture(autouse=True)
def no_tf32(device, monkeypatch):
    """float32 bounds mean float32 GEMMs (the MoE block's loop path), whatever an earlier test set."""
    if device.type == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.fixture
def triton_calls(device, monkeypatch) -> collections.Counter:
    """Calls into triton_moe's wrappers (CUDA only: that module imports triton). permute.py and moerl.kernels
    import them at call time, so wrapping the module attributes sees every call."""
    calls: collections.Counter = collections.Counter()
    if device.type == "cuda":
        from moerl.kernels import triton_moe

        for name in TRITON_WRAPPERS:
            def counted(*args, _fn=getattr(triton_moe, name), _name=name, **kw):
                calls[_name] += 1
                return _fn(*args, **kw)

            monkeypatch.setattr(triton_moe, name, counted)
    return calls


def assert_triton_ran(calls: collections.Counter, device: torch.device, names: list[str]) -> None:
    if device.type != "cuda":
        assert not calls  # the CPU smoke: the torch path, nothing counted
        return
    missing = [n for n in names if not calls[n]]
    assert not missing, f"the torch path ran instead of Triton's {missing} (kernels._TRITON={kernels._TRITON})"


def fwd_bwd(fn, inputs: list[torch.Tensor], device: torch.device, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """[fn's output, the gradient of each input], the float64 inputs cast to dtype on device; the upstream
    gradient is one float64 draw (seed) cast likewise, so every dtype sees the same one."""
    xs = [x.to(device=device, dtype=dtype).detach().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out.backward(grad.to(device=device, dtype=out.dtype))
    return [out.detach()] + [x.grad for x in xs]


def assert_close_to_float64(fn, inputs: list[torch.Tensor], device: torch.device, dtype: torch.dtype,
                            seed: int) -> None:
    want = fwd_bwd(fn, inputs, device, torch.float64, seed)  # use_triton is False for float64: the torch path
    got = fwd_bwd(fn, inputs, device, dtype, seed)
    errs = [rel_err(g, w) for g, w in zip(got, want, strict=True)]
    # `not e <= tol` rather than `e > tol`: NaN fails
    assert not any(not e <= TOL[dtype] for e in errs), f"{dtype}: rel. errors (out, grads...) {errs}"


def permute_sizes(device: torch.device, with_drops: bool) -> tuple[int, int, int, int]:
    """T, K, D and how many of the T*K pairs are dropped. D > 1024 (the kernels' widest block) and not a multiple
    of it: two column blocks, the second masked."""
    T, K, D, dropped = (2048, 8, 1800, 777) if device.type == "cuda" else (24, 4, 40, 7)
    return T, K, D, dropped if with_drops else 0


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_drops", [False, True], ids=["all-kept", "drops"])
def test_combine_weighted_matches_float64(device, dtype, with_drops, triton_calls):
    """Un-permute + weighted sum over slots (gather_weighted_sum), its backward to rows and router weights
    (combine_backward); with dropped pairs (capacity), which contribute nothing and get a zero weight gradient."""
    T, K, D, dropped = permute_sizes(device, with_drops)
    gen = torch.Generator().manual_seed(100 + with_drops)
    order_N = torch.randperm(T * K, generator=gen)[: T * K - dropped]
    y_ND = torch.randn(order_N.numel(), D, generator=gen, dtype=torch.float64)
    w_TK = torch.rand(T, K, generator=gen, dtype=torch.float64) + 0.1  # router weights: positive, none zero
    order_N = order_N.to(device)
    assert_close_to_float64(lambda y, w: combine_weighted(y, order_N, w), [y_ND, w_TK], device, dtype, seed=1)
    assert_triton_ran(triton_calls, device, ["gather_weighted_sum", "combine_backward"])


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_drops", [False, True], ids=["all-kept", "drops"])
def test_expand_tokens_matches_float64(device, dtype, with_drops, triton_calls):
    """Token rows copied into expert order; the backward sums each token's kept slots (gather_weighted_sum
    without weights, dropped slots skipped)."""
    T, K, D, dropped = permute_sizes(device, with_drops)
    gen = torch.Generator().manual_seed(200 + with_drops)
    order_N = torch.randperm(T * K, generator=gen)[: T * K - dropped].to(device)
    x_TD = torch.randn(T, D, generator=gen, dtype=torch.float64)
    assert_close_to_float64(lambda x: expand_tokens(x, order_N, K), [x_TD], device, dtype, seed=2)
    assert_triton_ran(triton_calls, device, ["gather_weighted_sum"])


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["fp32", "bf16"])
@pytest.mark.parametrize("I_cuda", [768, 1100])  # one column block of 1024; two, the second masked
def test_swiglu_matches_float64(device, dtype, I_cuda, triton_calls):
    """silu(gate) * up of the fused [N, 2I] projection, and its backward written straight into [N, 2I]."""
    N, I = (4096, I_cuda) if device.type == "cuda" else (37, I_cuda // 32)
    h_NF = torch.randn(N, 2 * I, generator=torch.Generator().manual_seed(300 + I_cuda), dtype=torch.float64)
    assert_close_to_float64(swiglu, [h_NF], device, dtype, seed=3)
    assert_triton_ran(triton_calls, device, ["swiglu_forward", "swiglu_backward"])


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["fp32", "bf16"])
def test_sparse_moe_block_matches_float64(device, dtype, triton_calls):
    """The whole block (router, dispatch, experts, combine) forward and the input's gradient. Routing is replayed
    from the float64 router: a near-tie must not pick other experts in bf16. On CUDA bf16 the experts run
    torch._grouped_mm with the SwiGLU kernel between the GEMMs; float32 takes the per-expert loop."""
    if device.type == "cuda":
        T, cfg = 4096, MoEModelConfig(hidden_size=512, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=4, head_dim=128)
    else:
        T, cfg = 64, MoEModelConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    gen = torch.Generator().manual_seed(400)
    block64 = SparseMoEBlock(cfg, experts_impl="loop").to(torch.float64)
    with torch.no_grad():
        for p in block64.parameters():
            p.normal_(0, 0.05, generator=gen)  # the router too: its weights start at zero
    block64.to(device)
    x_TD = torch.randn(T, cfg.hidden_size, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        replay_TK = block64.gate(x_TD.to(device)).topk_idx_TK
    block = copy.deepcopy(block64).to(dtype)
    block.experts.impl = "auto"

    def moe(x_TD):
        return (block64 if x_TD.dtype == torch.float64 else block)(x_TD, replay_TK).out_TD

    assert_close_to_float64(moe, [x_TD], device, dtype, seed=4)
    x_probe = torch.empty(1, cfg.hidden_size, device=device, dtype=dtype)
    grouped = grouped_mm_available(x_probe) and block.experts._grouped_mm_aligned(x_probe)
    assert_triton_ran(triton_calls, device, ["gather_weighted_sum", "combine_backward"]
                      + (["swiglu_forward", "swiglu_backward"] if grouped else []))
    if device.type == "cuda" and dtype == torch.bfloat16:
        assert grouped, "bf16 experts on this GPU should run torch._grouped_mm (Hopper or newer)"


@pytest.mark.cuda_only
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_sampler_matches_reference(device, logits_dtype):
    """gumbel_argmax_triton against gumbel_argmax_reference on the same logits at Qwen3's vocabulary (its last
    block of 1024 is partial): the same tokens (a flip needs two noisy logits within float rounding: at most one
    of B rows), greedy rows exactly the argmax; log-probs within 2e-5 of the reference's and, at the kernel's
    own tokens, of a float64 log-softmax."""
    from moerl.kernels.triton_sampling import gumbel_argmax_triton

    B, V = 256, 151_936
    params = [SamplingParams(temperature=[1.0, 1.0, 0.0, 0.6][i % 4], seed=10_000 + i) for i in range(B)]
    batch = SamplingBatch.empty(B, device)
    batch.set_rows(list(range(B)), params, [p.seed for p in params], [128 + i for i in range(B)])
    seed = 500 + (logits_dtype == torch.bfloat16)
    logits_BV = (2 * torch.randn(B, V, generator=torch.Generator(device=device).manual_seed(seed), device=device))
    logits_BV = logits_BV.to(logits_dtype)

    token_B, logprob_B = gumbel_argmax_triton(logits_BV, batch.temperature_B, noise_key(batch.seed_B, batch.position_B))
    want_token_B, want_logprob_B = gumbel_argmax_reference(logits_BV, batch)

    assert token_B.dtype == torch.int64 and logprob_B.dtype == torch.float32
    same_B = token_B == want_token_B
    assert int(same_B.sum()) >= B - 1, f"{B - int(same_B.sum())} of {B} tokens differ from the reference"
    greedy_B = batch.temperature_B == 0
    assert torch.equal(token_B[greedy_B], logits_BV[greedy_B].float().argmax(-1))
    err = float((logprob_B - want_logprob_B)[same_B].abs().max())
    assert err <= 2e-5, f"log-prob max err {err:.1e} against the torch reference"
    temp_B = torch.where(greedy_B, 1.0, batch.temperature_B).double()
    logp64_BV = torch.log_softmax(logits_BV.double() / temp_B[:, None], dim=-1)
    assert rel_err(logprob_B, logp64_BV.gather(1, token_B[:, None])[:, 0]) <= 1e-5
