"""`moerl bench logprobs`: forward + backward of the trainer's token log-probs from final hidden states
(moerl/model/logprobs.py) against the torch chunked path, the naive full-logits computation and Liger's fused
linear cross-entropy.

    python -m moerl.cli bench logprobs                    # N = 32,768 tokens, D = 1024, V = 151,936, bf16
    python -m moerl.cli bench logprobs --entropy          # with the entropy and its gradient (Liger has none)
    python -m moerl.cli bench logprobs --device cpu       # a tiny shape, the torch paths only

Ours is `chunked_token_logprobs` as the trainer calls it (on CUDA: cuBLAS GEMMs + the Triton kernels of
moerl/kernels/triton_logprobs.py); "torch chunked" the same function with fused=False; "naive" the [N, V] logits
and an fp32 log_softmax (`token_logprobs_reference`), where it fits in memory; Liger's
LigerFusedLinearCrossEntropyLoss (reduction "sum", fp32 grad_W accumulation like ours) on the same hidden, weight
and targets, where liger_kernel imports. The loss is -sum(logp) (+ sum(H) with --entropy), so every gradient is
that of a cross-entropy sum. The hardware limit is the GEMM work at the matmul peak measured in the same run: ours
runs 4 GEMMs of 2 N D V FLOPs (forward; backward's recompute, grad_hidden, grad_weight), Liger 3 (its forward
computes the gradients). Peak memory is above the inputs, gradients included.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
from typing import Callable

import torch

from moerl.bench import options
from moerl.bench.common import Row, device_description, format_table, measure_matmul_peak, time_fn
from moerl.model.logprobs import chunked_token_logprobs, token_logprobs_reference

CPU_SHAPE = (256, 64, 2000)  # N, D, V
NAIVE_BYTES_PER_LOGIT = 22  # bf16 logits, fp32 copy, log_softmax, its grad, exp/gather temporaries: measured ~20


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("logprobs").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def _liger_loss(temperature: float) -> Callable | None:
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float32)
    # no temperature argument: logits / tau are those of hidden / tau
    return lambda h, w, t: loss_fn(w, h / temperature if temperature != 1.0 else h, t)


def _steps(args: argparse.Namespace, device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    """name -> loss(hidden, weight, target); "ours" first."""
    tau, ent = args.temperature, args.entropy

    def ours(**kw) -> Callable[..., torch.Tensor]:
        def loss(h, w, t):
            logp, entropy = chunked_token_logprobs(h, w, t, with_entropy=ent, temperature=tau, **kw)
            return -logp.sum() + (entropy.sum() if ent else 0)
        return loss

    def naive(h, w, t):
        logp, entropy = token_logprobs_reference(h, w, t, ent, tau)
        return -logp.sum() + (entropy.sum() if ent else 0)

    steps = {"ours": ours(), "torch chunked": ours(fused=False), "naive": naive}
    liger = _liger_loss(tau) if device.type == "cuda" else None
    if liger is not None:
        steps["liger" + (" (no entropy)" if ent else "")] = liger
    return steps


def _fits_naive(N: int, V: int, device: torch.device) -> bool:
    return device.type != "cuda" or N * V * NAIVE_BYTES_PER_LOGIT < 0.9 * torch.cuda.mem_get_info(device)[0]


def _measure(loss_fn: Callable, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, device: torch.device,
             args: argparse.Namespace) -> tuple[float, float, torch.Tensor]:
    """(seconds per forward + backward, peak GiB above the inputs (nan off CUDA), grad of hidden)."""
    def step() -> None:
        h.grad = w.grad = None
        loss_fn(h, w, t).backward()

    seconds = time_fn(step, device, warmup=args.warmup, iters=args.iters)
    h.grad = w.grad = None
    peak = math.nan
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    else:
        step()
    grad = h.grad.detach().clone()
    h.grad = w.grad = None
    return seconds, peak, grad


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    gpu = device.type == "cuda"
    N, D, V = (args.tokens, args.hidden, args.vocab) if gpu else CPU_SHAPE
    dtype = torch.bfloat16 if gpu else torch.float32
    print(f"logprobs on {device_description(device)}: N={N} D={D} V={V} {dtype}, tau={args.temperature}, "
          f"entropy={'yes' if args.entropy else 'no'}" + ("" if gpu else " (CPU: a tiny shape, the torch paths)"))
    peak_flops = measure_matmul_peak(device)
    scale, unit = (1e12, "TFLOP/s") if gpu else (1e9, "GFLOP/s")
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(N, D, generator=g, device=device).to(dtype).requires_grad_(True)
    w = (torch.randn(V, D, generator=g, device=device) * (3 / D**0.5)).to(dtype).requires_grad_(True)
    t = torch.randint(0, V, (N,), generator=g, device=device)
    steps = _steps(args, device)
    if gpu and not any(name.startswith("liger") for name in steps):
        print("liger: not installed (pip install liger-kernel)")
    results: dict[str, tuple[float, float, float]] = {}  # name -> (s, GiB, GEMM FLOPs)
    want = None
    print(f"{'impl':<24} {'ms':>9} {'GEMM ' + unit:>13} {'of limit':>9} {'peak GiB':>9} {'grad_h vs ours':>15}")
    for name, loss_fn in steps.items():
        if name == "naive" and not _fits_naive(N, V, device):
            print(f"{name:<24} does not fit (~{N * V * NAIVE_BYTES_PER_LOGIT / 2**30:,.0f} GiB)")
            continue
        try:
            seconds, peak, grad = _measure(loss_fn, h, w, t, device, args)
        except torch.OutOfMemoryError:
            h.grad = w.grad = None
            gc.collect()
            torch.cuda.empty_cache()
            print(f"{name:<24} out of memory")
            continue
        want = grad if want is None else want
        flops = (6 if name.startswith("liger") else 8) * N * D * V
        results[name] = (seconds, peak, flops)
        diff = ((grad.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
        print(f"{name:<24} {seconds * 1e3:>9,.2f} {flops / seconds / scale:>13,.1f} "
              f"{100 * flops / seconds / peak_flops:>8.1f}% {peak:>9.2f} {diff:>15.1e}")
    print(f"hw limit: the GEMMs at the measured matmul peak {peak_flops / scale:,.0f} {unit}: "
          f"{8 * N * D * V / peak_flops * 1e3:,.2f} ms for 4 GEMMs of 2NDV (Liger's 3: "
          f"{6 * N * D * V / peak_flops * 1e3:,.2f} ms)")
    if "ours" not in results:
        return 1
    ours_s, ours_gib, ours_flops = results["ours"]
    for peer, (peer_s, peer_gib, peer_flops) in results.items():
        if peer == "ours":
            continue
        rows = [Row("ms per forward + backward", ours_s * 1e3, peer_s * 1e3, "ms", higher_is_better=False),
                Row(f"GEMM {unit} (own GEMMs)", ours_flops / ours_s / scale, peer_flops / peer_s / scale, unit,
                    ceiling=peak_flops / scale),
                Row("peak memory above inputs", ours_gib, peer_gib, "GiB", higher_is_better=False)]
        print()
        print(format_table(f"logprobs: ours vs {peer}", rows, peer_name=peer.split(" (")[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
