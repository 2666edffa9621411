"""`moerl bench paged-decode`: one decode step of the paged KV cache against the contiguous (slab) cache it
replaced, per context length.

    python -m moerl.cli bench paged-decode                  # CUDA: a 4-layer MoE, batch 64, contexts 128-3072
    python -m moerl.cli bench paged-decode --layers 8 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128 \\
        --experts 128 --top-k 8 --moe-inter 768 --vocab 151936 --batch 256 --max-seq-len 5120 \\
        --contexts 256,1024,4096                            # 30B-A3B's layer shape, 8 of its 48 layers
    python -m moerl.cli bench paged-decode --device cpu     # tiny sizes, eager: the bench's own code

Every request holds `context` positions; random-init weights, temperature 1. Ours is the engine's decode step
(moerl.rollout.Engine, paged cache, the Triton paged-decode kernel) replayed from its CUDA graph; beside it the
same engine gathering each row's blocks into a contiguous copy for SDPA (its path without triton) and the whole
`Engine.step()`, host work included. The peer is the slab decode the engine ran before the paged cache: a
[B, G, max_seq_len + 1, d] key and value slab per layer, masked SDPA over the whole slab, captured and replayed
the same way. On a CPU there are no graphs: each step runs eagerly and ours is the engine's step (the gather path).
The hardware limit is the bytes one step must read (the weights the batch touches, the KV of `context` positions:
moerl.bench.rollout.decode_step_bytes) at the device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

from moerl.bench import options
from moerl.bench.common import Row, device_description, format_table, measure_copy_bandwidth, time_fn
from moerl.bench.rollout import decode_step_bytes
from moerl.model import MoEModelConfig, build_model
from moerl.rollout import Engine, EngineConfig, SamplingParams
from moerl.rollout.sampling import SamplingBatch, sample

CPU_SIZES = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2, moe_inter=32, vocab=256,
                 batch=4, max_seq_len=64, contexts="8,32")


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("paged-decode").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


class SlabView:
    """One layer of the slab cache as the engine used it before the paged cache (the peer)."""

    def __init__(self, k_NGSd: torch.Tensor, v_NGSd: torch.Tensor, pos_B: torch.Tensor,
                 mask_B11S: torch.Tensor) -> None:
        self.k_NGSd, self.v_NGSd, self.pos_B, self.mask_B11S = k_NGSd, v_NGSd, pos_B, mask_B11S

    def attend(self, q_BHTd: torch.Tensor, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor) -> torch.Tensor:
        B = q_BHTd.shape[0]
        rows_B1 = torch.arange(B, device=q_BHTd.device)[:, None]
        self.k_NGSd[rows_B1, :, self.pos_B[:, None]] = k_BGTd.transpose(1, 2)
        self.v_NGSd[rows_B1, :, self.pos_B[:, None]] = v_BGTd.transpose(1, 2)
        return F.scaled_dot_product_attention(q_BHTd, self.k_NGSd[:B], self.v_NGSd[:B], attn_mask=self.mask_B11S,
                                              enable_gqa=q_BHTd.shape[1] != k_BGTd.shape[1])


def replay_seconds(graph: torch.cuda.CUDAGraph, iters: int = 30) -> float:
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


@torch.no_grad()
def slab_step_seconds(model, arch: MoEModelConfig, B: int, S: int, ctx: int, device: torch.device) -> float:
    """One decode step of B rows at position `ctx` over a slab of S + 1 positions: replayed from a CUDA graph,
    or eagerly on a CPU."""
    dtype = next(model.parameters()).dtype
    shape = (B, arch.num_key_value_heads, S + 1, arch.head_dim)
    ks = [torch.randn(shape, dtype=dtype, device=device) for _ in range(arch.num_hidden_layers)]
    vs = [torch.randn(shape, dtype=dtype, device=device) for _ in range(arch.num_hidden_layers)]
    ids_B = torch.randint(0, arch.vocab_size, (B,), device=device)
    pos_B = torch.full((B,), ctx, device=device)
    sampling = SamplingBatch.empty(B, device)

    def step():
        mask_B11S = (torch.arange(S + 1, device=device)[None, :] <= pos_B[:, None])[:, None, None, :]
        views = [SlabView(k, v, pos_B, mask_B11S) for k, v in zip(ks, vs)]
        out = model.forward_full(ids_B[:, None], position_ids_BT=pos_B[:, None], kv_caches=views)
        return sample(out.logits_BTV[:, -1], sampling, any_filter=False)

    if device.type != "cuda":
        return time_fn(step, device, warmup=1, iters=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(), step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seconds = replay_seconds(graph)
    del graph  # its closure holds the slab until this function returns
    torch.cuda.empty_cache()
    return seconds


@torch.no_grad()
def paged_step_seconds(model, arch: MoEModelConfig, B: int, S: int, ctx: int, kernel: bool) -> tuple[float, float]:
    """(the decode graph replayed alone, NaN without graphs; a whole Engine.step()) with B requests decoding at
    `ctx` positions, seconds."""
    engine = Engine(model, EngineConfig(max_batch_size=B, max_seq_len=S, kv_cache_tokens=B * S + 16,
                                        prefill_chunk=min(ctx, 2048), max_prefill_tokens=1 << 16, admit_batch=B,
                                        prefix_caching=False))
    engine.cache.decode_kernel = kernel and engine.cache.decode_kernel  # before the first graph is captured
    gen = torch.Generator().manual_seed(0)
    for i in range(B):
        prompt = torch.randint(0, arch.vocab_size, (ctx,), generator=gen).tolist()
        engine.submit(prompt, SamplingParams(max_new_tokens=S - ctx, temperature=1.0, seed=i))
    while engine.stats["decode_steps"] < 3:  # prefill, then capture the decode graph
        engine.step()
    cuda = engine.device.type == "cuda"
    steps = 10 if cuda else 3
    if cuda:
        torch.cuda.synchronize(engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if cuda:
        torch.cuda.synchronize(engine.device)
    step_s = (time.perf_counter() - t0) / steps
    captured = engine.graphs.captured if engine.graphs is not None else {}
    graph = captured[max(captured, key=lambda k: k[0])][0] if captured else None  # the B-row bucket
    replay_s = replay_seconds(graph) if graph is not None else math.nan
    del engine, graph, captured  # the graphs and their memory pools go before the next engine is built
    if cuda:
        torch.cuda.empty_cache()
    return replay_s, step_s


def rows(B: int, ctx: int, t: dict[str, float], floor_s: float) -> list[Row]:
    """Decode tok/s at one context against the slab's, each with the HBM floor's tok/s as its ceiling. With graphs
    (t["kernel"] finite): the kernel's replayed step, the gather path's (when timed) and the whole Engine.step()
    (no peer: host work the slab's replay does not have). Without (a CPU): the eager Engine.step() alone."""
    rate = lambda s: B / s  # noqa: E731
    ceiling, slab = B / floor_s, rate(t["slab"])
    if not math.isfinite(t["kernel"]):
        return [Row(f"ctx {ctx}: Engine.step(), eager", rate(t["step"]), slab, "tok/s", ceiling=ceiling)]
    out = [Row(f"ctx {ctx}: decode step, paged kernel", rate(t["kernel"]), slab, "tok/s", ceiling=ceiling)]
    if math.isfinite(t.get("gather", math.nan)):
        out.append(Row(f"ctx {ctx}: decode step, paged gather + SDPA", rate(t["gather"]), slab, "tok/s",
                       ceiling=ceiling))
    out.append(Row(f"ctx {ctx}: Engine.step(), host included", rate(t["step"]), None, "tok/s", ceiling=ceiling))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    gpu = device.type == "cuda"
    if not gpu:
        vars(args).update(CPU_SIZES)
    dtype = torch.bfloat16 if gpu else torch.float32
    arch = MoEModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, head_dim=args.head_dim, num_experts=args.experts,
                          num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_inter,
                          max_position_embeddings=max(4096, args.max_seq_len + 1))
    model = build_model(arch, dtype=dtype, device=device, seed=0).eval()
    B, S = args.batch, args.max_seq_len
    params = sum(p.numel() for p in model.parameters())
    print(f"paged-decode on {device_description(device)}: {params / 1e9:.2f}B-parameter MoE ({args.layers} layers, "
          f"hidden {args.hidden}, {args.experts} experts top-{args.top_k}, heads {args.heads}/{args.kv_heads}x"
          f"{args.head_dim}), {dtype}, batch {B}, max_seq_len {S}", flush=True)
    copy_bw = measure_copy_bandwidth(device)
    table: list[Row] = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        if ctx >= S:
            print(f"context {ctx}: skipped, it must be below max_seq_len {S}")
            continue
        t = {"slab": slab_step_seconds(model, arch, B, S, ctx, device)}
        t["kernel"], t["step"] = paged_step_seconds(model, arch, B, S, ctx, kernel=gpu)
        if gpu and args.gather:
            t["gather"] = paged_step_seconds(model, arch, B, S, ctx, kernel=False)[0]
        weights, kv = decode_step_bytes(arch, B, ctx, torch.finfo(dtype).bits // 8)
        floor_s = (weights + kv) / copy_bw
        print(f"context {ctx}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items() if math.isfinite(v))
              + f"; floor {floor_s * 1e3:.3f} ms ({weights / 1e9:.3g} GB of weights + {kv / 1e9:.3g} GB of KV)",
              flush=True)
        table += rows(B, ctx, t, floor_s)
    print()
    print(format_table("paged-decode: ours (paged cache) vs the slab cache it replaced, decode tok/s", table,
                       peer_name="slab"))
    print(f"hw limit: the bytes one step must read at the measured copy bandwidth {copy_bw / 1e9:,.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
