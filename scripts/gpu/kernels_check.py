"""Check the Triton MoE kernels against the torch reference in float64, and the fused sampler against its torch
reference (run on a CUDA host).

    python3 scripts/gpu/kernels_check.py

Fresh random inputs per check, outputs poisoned first; prints PASS/FAIL per check and exits non-zero on FAIL.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a source tree, moerl not installed

import torch  # noqa: E402

import moerl.kernels as kernels
from moerl.ep.permute import combine_weighted, expand_tokens
from moerl.kernels import swiglu
from moerl.model.config import MoEModelConfig
from moerl.model.moe import SparseMoEBlock

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if torch.isnan(a).any():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run(fn, inputs: list[torch.Tensor], device: str, dtype: torch.dtype, triton: bool):
    kernels._TRITON = triton
    xs = [x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype).detach() for x in inputs]
    for x in xs:
        if x.is_floating_point():
            x.requires_grad_(True)
    out = fn(*xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(g.to(device=device, dtype=out.dtype))
    return [out.detach()] + [x.grad for x in xs if x.is_floating_point()]


def check(name: str, fn, inputs, failures: list[str]) -> None:
    ref = run(fn, inputs, "cpu", torch.float64, triton=False)
    for dtype in (torch.float32, torch.bfloat16):
        got = run(fn, inputs, "cuda", dtype, triton=True)
        errs = [rel(a, b) for a, b in zip(got, ref)]
        ok = all(e <= TOL[dtype] for e in errs)
        print(f"{'PASS' if ok else 'FAIL'} {name} {dtype}: rel. errors (out, grads) {['%.1e' % e for e in errs]}")
        if not ok:
            failures.append(f"{name} {dtype}")


def check_sampler(failures: list[str], B: int = 256, V: int = 151_936) -> None:
    """The fused Gumbel-max sampler against its torch reference on the same CUDA logits: same tokens (a flip
    needs two noisy logits within float rounding: expect none in B rows), log-probs within 2e-5; and both timed."""
    from moerl.bench.common import time_fn
    from moerl.kernels.triton_sampling import gumbel_argmax_triton
    from moerl.rollout.sampling import SamplingBatch, SamplingParams, gumbel_argmax_reference, noise_key

    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=[1.0, 1.0, 0.0, 0.6][i % 4], seed=10_000 + i) for i in range(B)]
    batch = SamplingBatch.empty(B, "cuda")
    batch.set_rows(list(range(B)), params, [p.seed for p in params], [128 + i for i in range(B)])
    key = noise_key(batch.seed_B, batch.position_B)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (2 * torch.randn(B, V, generator=gen)).to(device="cuda", dtype=dtype)
        tok, lp = gumbel_argmax_triton(logits, batch.temperature_B, key)
        ref_tok, ref_lp = gumbel_argmax_reference(logits, batch)
        same = int((tok == ref_tok).sum())
        err = float((lp - ref_lp).abs().max())
        t_fused = time_fn(lambda: gumbel_argmax_triton(logits, batch.temperature_B, key), torch.device("cuda"))
        t_ref = time_fn(lambda: gumbel_argmax_reference(logits, batch), torch.device("cuda"))
        ok = same >= B - 1 and err <= 2e-5
        print(f"{'PASS' if ok else 'FAIL'} gumbel_argmax {dtype} [{B}, {V}]: {same}/{B} tokens equal, log-prob "
              f"max err {err:.1e}; fused {t_fused * 1e6:.0f} us, torch reference {t_ref * 1e6:.0f} us")
        if not ok:
            failures.append(f"gumbel_argmax {dtype}")


def main() -> int:
    assert torch.cuda.is_available(), "needs a CUDA device"
    failures: list[str] = []
    gen = torch.Generator().manual_seed(0)
    T, K, D = 3000, 8, 2048
    for kept in (T * K, T * K - 777):
        order = torch.randperm(T * K, generator=gen)[:kept]
        y = torch.randn(kept, D, generator=gen, dtype=torch.float64)
        w = torch.rand(T, K, generator=gen, dtype=torch.float64)
        check(f"combine_weighted kept={kept}", lambda y, w, o=order.cuda(): combine_weighted(y, o.to(y.device), w), [y, w], failures)
        x = torch.randn(T, D, generator=gen, dtype=torch.float64)
        check(f"expand_tokens kept={kept}", lambda x, o=order: expand_tokens(x, o.to(x.device), K), [x], failures)
    h = torch.randn(5000, 2 * 768, generator=gen, dtype=torch.float64)
    check("swiglu", swiglu, [h], failures)
    cfg = MoEModelConfig(hidden_size=512, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=128)
    block = SparseMoEBlock(cfg, experts_impl="auto")
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05, generator=gen)
    x = torch.randn(4096, 512, generator=gen, dtype=torch.float64)
    block.to(torch.float64)
    replay = block.gate(x).topk_idx_TK  # fixed routing: bf16 near-ties must not flip experts

    def moe(x, b=block):
        b.to(device=x.device, dtype=x.dtype)
        b.experts.impl = "loop" if x.dtype == torch.float64 else "auto"
        return b(x, replay.to(x.device)).out_TD
    check("SparseMoEBlock (grouped_mm + kernels)", moe, [x], failures)
    check_sampler(failures)
    print("kernels_check:", "all passed" if not failures else f"FAILED {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
