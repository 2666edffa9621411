"""`moerl bench moe-decode`: one MoE block's forward at decode sizes (no grad): the fused Triton path against our
grouped GEMM path and transformers' Qwen3MoeSparseMoeBlock (its fastest experts implementation).

    python -m moerl.cli bench moe-decode                  # Qwen3-30B-A3B expert shape, T = 1..512 tokens
    python -m moerl.cli bench moe-decode --shape 0.9b     # the 0.92B rollout preset's
    python -m moerl.cli bench moe-decode --tune           # sweep block configs, print the table's literal
    python -m moerl.cli bench moe-decode --device cpu     # tiny shapes, the fused path's torch reference

A decode step runs every layer once, so no layer's weights are in L2 when it starts: each timed call runs L
blocks with distinct weights in turn (L x the weights touched at T=1 >= 256 MB, 5x the 50 MB L2) and reports
the time per block. Our paths replay a CUDA graph of the L calls, as the engine decodes; transformers' too where
it captures, else eagerly (marked). GB/s counts the weights the routing touches (distinct experts x 3*D*I plus
the router) per call; the ceiling is the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

import torch

from moerl.bench import options
from moerl.bench.common import (Row, device_description, format_table, measure_copy_bandwidth, time_fn,
                                weight_copies)
from moerl.kernels.fused_moe import fused_moe_reference
from moerl.model.config import MoEModelConfig
from moerl.model.moe import SparseMoEBlock

SHAPES = {"30b": (128, 2048, 768), "0.9b": (64, 1024, 256)}  # E, D, I (top-8 both)
CPU_SHAPE = (8, 64, 32)
TOP_K = 8
PEER_IMPLS = ("grouped_mm", "batched_mm", "eager")


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("moe-decode").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def model_config(E: int, D: int, I: int, K: int = TOP_K) -> MoEModelConfig:
    return MoEModelConfig(hidden_size=D, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                          norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=4, head_dim=D // 4)


def build_blocks(cfg: MoEModelConfig, L: int, device: torch.device, dtype: torch.dtype) -> list[SparseMoEBlock]:
    gen = torch.Generator(device=device).manual_seed(0)
    blocks = []
    for _ in range(L):
        block = SparseMoEBlock(cfg).to(device=device, dtype=dtype)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02, generator=gen)
        blocks.append(block.requires_grad_(False))
    return blocks


def peer_block(cfg: MoEModelConfig, impl: str, ours: SparseMoEBlock):
    """transformers' block on our very tensors (built on the meta device, so no second copy), or None."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError:
        return None
    hf = Qwen3MoeConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    hf._experts_implementation = impl
    with torch.device("meta"):
        block = Qwen3MoeSparseMoeBlock(hf)
    block.gate.weight = ours.gate.weight
    block.experts.gate_up_proj = ours.experts.gate_up_proj
    block.experts.down_proj = ours.experts.down_proj
    if any(t.is_meta for t in (*block.parameters(), *block.buffers())):
        raise RuntimeError("transformers' block has state beyond the router and expert weights")
    return block


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
    """fn in a CUDA graph after a side-stream warm-up, or None where it does not capture (host syncs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001 - a host sync inside (e.g. transformers' eager experts): time it eagerly
        torch.cuda.synchronize()
        return None
    return graph


def time_per_call(fn: Callable[[], object], calls: int, device: torch.device, args: argparse.Namespace,
                  graph: bool) -> tuple[float, bool]:
    """(seconds per block call, whether a graph ran); fn makes `calls` block calls."""
    g = capture(fn) if graph and device.type == "cuda" else None
    run = g.replay if g is not None else fn
    return time_fn(run, device, warmup=args.warmup, iters=args.iters) / calls, g is not None


def touched_bytes(blocks: list[SparseMoEBlock], x_TD: torch.Tensor, D: int, I: int) -> float:
    """Mean over the blocks of the weight bytes one call reads: distinct routed experts' gate, up, down + router."""
    size = blocks[0].experts.down_proj.element_size()
    distinct = [torch.unique(b.gate(x_TD).topk_idx_TK).numel() for b in blocks]
    return (sum(distinct) / len(distinct)) * 3 * D * I * size + blocks[0].gate.weight.numel() * size


def run_shape(name: str, E: int, D: int, I: int, device: torch.device, args: argparse.Namespace,
              copy_bw: float) -> None:
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    cfg = model_config(E, D, I)
    L = weight_copies(E, D, I, TOP_K, torch.finfo(dtype).bits // 8) if gpu else 2  # CPU: no L2 to defeat
    blocks = build_blocks(cfg, L, device, dtype)
    impls = PEER_IMPLS if args.peer == "all" else tuple(i for i in args.peer.split(",") if i and i != "none")
    peers = {impl: [peer_block(cfg, impl, b) for b in blocks] for impl in impls}
    peers = {impl: ps for impl, ps in peers.items() if ps and ps[0] is not None}
    print(f"\nmoe-decode {name}: hidden={D} experts={E} top-{TOP_K} intermediate={I} {dtype}, "
          f"{L} blocks of distinct weights per timed call")
    header = (f"{'T':>5} {'fused':>9} {'fused':>9} {'grouped':>9} {'transformers':>18} {'fused':>8} {'of copy':>8} "
              f"{'fused vs':>9} {'vs tf':>6} {'rel diff':>9}")
    print(header)
    print(f"{'':>5} {'graph us':>9} {'eager us':>9} {'graph us':>9} {'us (best impl)':>18} {'GB/s':>8} {'bw':>8} "
          f"{'grouped':>9} {'':>6} {'vs grouped':>9}")
    headline = None
    for T in [int(t) for t in args.tokens.split(",") if t]:
        x_TD = torch.randn(T, D, device=device, dtype=dtype)
        with torch.no_grad():
            def ours(impl: str) -> Callable[[], list]:
                for b in blocks:
                    b.experts.impl = impl
                if impl == "fused" and not gpu:  # the CPU smoke: the fused path's torch reference
                    return lambda: [_reference(b, x_TD) for b in blocks]
                return lambda: [b(x_TD).out_TD for b in blocks]

            fused_out = ours("fused")()[0].float()
            fused_g, _ = time_per_call(ours("fused"), L, device, args, graph=True)
            fused_e, _ = time_per_call(ours("fused"), L, device, args, graph=False)
            grouped_out = ours("grouped_mm" if gpu else "auto")()[0].float()
            grouped_g, _ = time_per_call(ours("grouped_mm" if gpu else "auto"), L, device, args, graph=True)
            best = (math.inf, "-", "")
            for impl, ps in peers.items():
                try:
                    seconds, graphed = time_per_call(lambda ps=ps: [p(x_TD.unsqueeze(0)) for p in ps], L, device,
                                                     args, graph=True)
                except (RuntimeError, torch.OutOfMemoryError) as e:
                    print(f"  transformers {impl!r} failed at T={T}: {str(e).splitlines()[0][:100]}")
                    continue
                best = min(best, (seconds, impl, "" if graphed else ", eager"))
            nbytes = touched_bytes(blocks, x_TD, D, I)
        diff = ((fused_out - grouped_out).norm() / grouped_out.norm().clamp_min(1e-30)).item()
        peer = f"{best[0] * 1e6:,.1f} ({best[1]}{best[2]})" if math.isfinite(best[0]) else "-"
        print(f"{T:>5} {fused_g * 1e6:>9,.1f} {fused_e * 1e6:>9,.1f} {grouped_g * 1e6:>9,.1f} {peer:>18} "
              f"{nbytes / fused_g / 1e9:>8,.0f} {100 * nbytes / fused_g / copy_bw:>7.1f}% "
              f"{grouped_g / fused_g:>8.2f}x {best[0] / fused_g:>5.2f}x {diff:>9.1e}")
        if headline is None or T <= 256:
            headline = (T, fused_g, best[0], best[1], nbytes)
    T, fused_s, peer_s, impl, nbytes = headline
    peer_s = peer_s if math.isfinite(peer_s) else None
    rows = [Row(f"us per block call at T={T}", fused_s * 1e6, peer_s * 1e6 if peer_s else None, "us",
                higher_is_better=False),
            Row("GB/s of touched weights", nbytes / fused_s / 1e9, nbytes / peer_s / 1e9 if peer_s else None, "GB/s",
                ceiling=copy_bw / 1e9)]
    print(format_table(f"moe-decode {name} (peer: transformers Qwen3MoeSparseMoeBlock, experts_implementation="
                       f"{impl!r})", rows, peer_name="transformers"))
    for b in blocks:
        b.experts.impl = "auto"


def _reference(block: SparseMoEBlock, x_TD: torch.Tensor) -> torch.Tensor:
    routed = block.gate(x_TD)
    return fused_moe_reference(x_TD, routed.topk_idx_TK, routed.topk_weights_TK, block.experts.gate_up_proj,
                               block.experts.down_proj)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda":
        from moerl.kernels.fused_moe import fused_moe_unavailable

        reason = fused_moe_unavailable(torch.empty(1, device=device, dtype=torch.bfloat16))
        if reason is not None:
            print(f"moe-decode: the fused path cannot run here: {reason}")
            return 2
    names = list(SHAPES) if args.shape == "all" or (args.shape is None and args.tune) else [args.shape or "30b"]
    print(f"moe-decode on {device_description(device)}")
    if args.tune:
        if device.type != "cuda":
            print("moe-decode --tune needs CUDA and triton (it times the Triton kernels)")
            return 2
        from moerl.bench.moe_decode_tune import tune

        tune({n: SHAPES[n] for n in names}, TOP_K, device)
        return 0
    copy_bw = measure_copy_bandwidth(device)
    print(f"hw limit: measured copy bandwidth {copy_bw / 1e9:,.0f} GB/s (read + write)")
    for name in names:
        E, D, I = SHAPES[name] if device.type == "cuda" else CPU_SHAPE
        run_shape(name if device.type == "cuda" else f"{name} (CPU: tiny shape, the shape of the costs only)",
                  E, D, I, device, args, copy_bw)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
