"""`moerl bench moe-layer`: the MoE block forward+backward against transformers' Qwen3MoeSparseMoeBlock.

    python -m moerl.cli bench moe-layer                 # Qwen3-30B-A3B shapes, bf16, 16,384 tokens (GPU)
    python -m moerl.cli bench moe-layer --device cpu    # scaled-down shapes: the shape of the costs only

Both blocks get the same weights and inputs in one process. The peer runs every experts implementation
transformers offers that works here ("eager", "grouped_mm", "batched_mm") and the fastest is reported.
Expert-GEMM TFLOP/s times the two grouped GEMMs alone (forward+backward) on the routing the router made.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moerl.bench import options
from moerl.bench.common import Row, device_description, format_table, measure_matmul_peak, time_fn
from moerl.model.config import MoEModelConfig
from moerl.model.moe import SparseMoEBlock

PEER_IMPLS = ("grouped_mm", "batched_mm", "eager")


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("moe-layer").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def _shapes(args: argparse.Namespace, device: torch.device) -> tuple[int, int, int, int, torch.dtype]:
    gpu = device.type == "cuda"
    T = args.tokens or (16384 if gpu else 512)
    D = args.hidden or (2048 if gpu else 256)
    E = args.experts or (128 if gpu else 16)
    I = args.intermediate or (768 if gpu else 128)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: torch.bfloat16 if gpu else torch.float32}[args.dtype]
    return T, D, E, I, dtype


def _peer_block(config: MoEModelConfig, impl: str, ours: SparseMoEBlock):
    """transformers' block with our weights, or None if transformers is not installed."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError:
        return None
    hf_config = Qwen3MoeConfig(**{k: v for k, v in config.to_hf_dict().items() if k not in ("architectures", "model_type")})
    hf_config._experts_implementation = impl
    block = Qwen3MoeSparseMoeBlock(hf_config).to(device=ours.gate.weight.device, dtype=ours.gate.weight.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(ours.gate.weight)
        block.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        block.experts.down_proj.copy_(ours.experts.down_proj)
    return block


def expert_gemm_flops(T: int, K: int, D: int, I: int) -> int:
    """FLOPs of the expert GEMMs of one forward + backward: each of T tokens through K experts, a gate-up [D, 2I]
    and a down [I, D] projection (2 FLOPs a multiply-add), forward once and backward twice (input and weight)."""
    return 3 * 2 * T * K * (D * 2 * I + I * D)


def _step(forward, params, x_TD: torch.Tensor, grad_TD: torch.Tensor):
    def run():
        for p in params:
            p.grad = None
        x_TD.grad = None
        out = forward(x_TD)
        out.backward(grad_TD)
        return out
    return run


def _profile(name: str, fn, device: torch.device) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(f"--- profile: {name}")
    print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    T, D, E, I, dtype = _shapes(args, device)
    K = args.topk
    torch.manual_seed(0)
    config = MoEModelConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                            norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=4, head_dim=D // 4)
    ours = SparseMoEBlock(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.02)
    x_TD = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    grad_TD = torch.randn(T, D, device=device, dtype=dtype)
    print(f"moe-layer: tokens={T} hidden={D} experts={E} top-{K} intermediate={I} {dtype} on {device_description(device)}")

    ours_step = _step(lambda x: ours(x).out_TD, list(ours.parameters()), x_TD, grad_TD)
    ours_out = ours_step().detach().float()
    ours_s = time_fn(ours_step, device, warmup=args.warmup, iters=args.iters)

    peer_s, peer_impl, max_rel_err = None, "-", None
    impls = PEER_IMPLS if args.peer == "all" else tuple(i for i in args.peer.split(",") if i and i != "none")
    for impl in impls:
        block = _peer_block(config, impl, ours)
        if block is None:
            print("transformers is not installed: no peer column")
            break
        step = _step(lambda x, b=block: b(x.unsqueeze(0)).squeeze(0), list(block.parameters()), x_TD, grad_TD)
        try:
            out = step().detach().float()
            seconds = time_fn(step, device, warmup=args.warmup, iters=args.iters)
        except (RuntimeError, torch.OutOfMemoryError) as e:  # batched_mm runs out of memory at full size
            print(f"transformers experts_implementation={impl!r} failed here: {str(e).splitlines()[0][:120]}")
            del block
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        err = ((out - ours_out).norm() / out.norm()).item()
        print(f"transformers experts_implementation={impl!r}: {seconds * 1e3:.2f} ms/step, rel. diff to moerl {err:.2e}")
        if peer_s is None or seconds < peer_s:
            peer_s, peer_impl, max_rel_err = seconds, impl, err
        if args.profile:
            _profile(f"transformers {impl}", step, device)
        del block, step

    # The expert GEMMs alone, on the routing this router produced.
    routed = ours.gate(x_TD.detach())
    x_ND, counts_L, _ = ours.dispatcher.dispatch(x_TD.detach(), routed.topk_idx_TK, routed.topk_weights_TK)
    x_ND.requires_grad_(True)
    gemm_grad_ND = torch.randn_like(x_ND)
    gemm_step = _step(lambda x: ours.experts(x, counts_L), list(ours.experts.parameters()), x_ND, gemm_grad_ND)
    gemm_s = time_fn(gemm_step, device, warmup=args.warmup, iters=args.iters)
    gemm_flops = expert_gemm_flops(T, K, D, I)
    peak = measure_matmul_peak(device)
    if args.profile:
        _profile("moerl", ours_step, device)

    rows = [
        Row("layer fwd+bwd", ours_s * 1e3, peer_s * 1e3 if peer_s else None, "ms", higher_is_better=False),
        Row("tokens/s", T / ours_s, T / peer_s if peer_s else None, "tok/s"),
        Row("layer TFLOP/s (expert GEMMs' flops)", gemm_flops / ours_s / 1e12,
            gemm_flops / peer_s / 1e12 if peer_s else None, "TFLOP/s", ceiling=peak / 1e12),
        Row("expert GEMMs alone", gemm_flops / gemm_s / 1e12, None, "TFLOP/s", ceiling=peak / 1e12),
    ]
    print(format_table(f"\nmoe-layer fwd+bwd (peer: transformers Qwen3MoeSparseMoeBlock, experts_implementation={peer_impl!r})",
                       rows, peer_name="transformers"))
    print(f"hw limit: measured dense {'bf16' if device.type == 'cuda' else 'fp32'} matmul peak {peak / 1e12:.1f} TFLOP/s"
          + (f"; output rel. diff vs peer {max_rel_err:.2e}" if max_rel_err is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
