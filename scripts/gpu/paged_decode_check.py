"""Time the paged decode path on a GPU against the slab cache it replaced; --eks: the eks-p5en rollout engine.

    python scripts/gpu/paged_decode_check.py                       # small model: timings
    python scripts/gpu/paged_decode_check.py --layers 8 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128 \
        --experts 128 --top-k 8 --moe-inter 768 --vocab 151936 --batch 256 --max-seq-len 5120 \
        --contexts 256,1024,4096                                   # 30B-A3B's layer shape, 8 of its 48 layers
    python scripts/gpu/paged_decode_check.py --eks                 # eks-p5en's rollout engine, 30B-A3B shape

1. timing, per context length (every request holding that many positions): one decode step replayed from its
   CUDA graph for (a) the slab decode the engine captured before (a [B, G, max_seq_len + 1, d] slab per layer,
   masked attention over the whole slab), (b) the paged engine with the Triton kernel, (c) the paged engine
   gathering blocks + SDPA (its fallback without triton); and the paged engine's whole step() (host work
   included), as decode tokens per second. Random-init weights, temperature 1.
2. --eks (alone): configs/eks-p5en.toml's rollout engine (256 x 5120) starts at Qwen3-30B-A3B's shape and runs a
   GRPO-like load of 16 groups x 16 samples; exits non-zero when it fails.
The correctness checks (the kernel against the float64 reference, eagerly and in a CUDA graph; the engine against
full forwards, and with CUDA graphs against eager) are tests/gpu/test_paged_decode_gpu.py (`make test-gpu`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a source tree, moerl not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moerl.model import MoEModelConfig, build_model  # noqa: E402
from moerl.rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from moerl.rollout.sampling import SamplingBatch, sample  # noqa: E402

@torch.no_grad()
def check_eks_p5en(failures: list[str]) -> None:
    """configs/eks-p5en.toml's rollout settings (256 x 5120) at Qwen3-30B-A3B's shape (random weights) on this
    GPU: the plan before the weights load, the engine starting, and a GRPO-like load (16 groups of 16 samples,
    1,000-token prompts, 1,024 new tokens at temperature 1: the groups share their prompts' blocks)."""
    from moerl.bench.rollout import random_model
    from moerl.bench.rollout_workload import qwen3_30b_a3b_config
    from moerl.config import load_config
    from moerl.rollout.memory import plan_for_device

    r = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "eks-p5en.toml"), []).rollout
    config = EngineConfig(max_batch_size=r.max_batch_size, max_seq_len=r.max_seq_len, kv_block_size=r.kv_block_size,
                          kv_cache_tokens=r.kv_cache_tokens, gpu_memory_fraction=r.gpu_memory_fraction,
                          prefix_caching=r.prefix_caching)
    arch = qwen3_30b_a3b_config()
    print(f"\neks-p5en rollout settings at the 30B-A3B shape, before the weights: "
          f"{plan_for_device(arch, config, torch.bfloat16, 'cuda').describe()}", flush=True)
    try:
        engine = Engine(random_model(arch, torch.bfloat16, torch.device("cuda")), config)
        print(f"engine started: {engine.plan.describe()}", flush=True)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, arch.vocab_size, (1000,), generator=gen).tolist() for _ in range(16)]
        params = [SamplingParams(max_new_tokens=1024, temperature=1.0, seed=i) for i in range(256)]
        t0 = time.perf_counter()
        done = engine.generate([p for p in prompts for _ in range(16)], params)
        seconds = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        print(f"FAIL eks-p5en at the 30B shape: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        failures.append("eks-p5en 30B start")
        return
    tokens, st = sum(len(c.token_ids) for c in done), engine.stats
    print(f"PASS eks-p5en at the 30B shape: 256 samples, {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.0f} "
          f"tok/s); prefill {st['prefill_tokens']} tokens, prefix hits {st['prefix_hit_tokens']}, preemptions "
          f"{st['preemptions']}; peak allocated {torch.cuda.max_memory_allocated() / 1e9:.1f} GB of "
          f"{torch.cuda.get_device_properties(0).total_memory / 1e9:.1f} GB")
    del engine, done
    torch.cuda.empty_cache()


class SlabView:
    """One layer of the slab cache as the engine used it before the paged cache (the timing baseline)."""

    def __init__(self, k_NGSd, v_NGSd, pos_B, mask_B11S) -> None:
        self.k_NGSd, self.v_NGSd, self.pos_B, self.mask_B11S = k_NGSd, v_NGSd, pos_B, mask_B11S

    def attend(self, q_BHTd, k_BGTd, v_BGTd):
        B = q_BHTd.shape[0]
        rows_B1 = torch.arange(B, device=q_BHTd.device)[:, None]
        self.k_NGSd[rows_B1, :, self.pos_B[:, None]] = k_BGTd.transpose(1, 2)
        self.v_NGSd[rows_B1, :, self.pos_B[:, None]] = v_BGTd.transpose(1, 2)
        return F.scaled_dot_product_attention(q_BHTd, self.k_NGSd[:B], self.v_NGSd[:B], attn_mask=self.mask_B11S,
                                              enable_gqa=q_BHTd.shape[1] != k_BGTd.shape[1])


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 30) -> float:
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@torch.no_grad()
def slab_step_ms(model, arch, B: int, S: int, ctx: int) -> float:
    shape = (B, arch.num_key_value_heads, S + 1, arch.head_dim)
    ks = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(arch.num_hidden_layers)]
    vs = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(arch.num_hidden_layers)]
    ids_B = torch.randint(0, arch.vocab_size, (B,), device="cuda")
    pos_B = torch.full((B,), ctx, device="cuda")
    sampling = SamplingBatch.empty(B, "cuda")

    def step():
        mask_B11S = (torch.arange(S + 1, device="cuda")[None, :] <= pos_B[:, None])[:, None, None, :]
        views = [SlabView(k, v, pos_B, mask_B11S) for k, v in zip(ks, vs)]
        out = model.forward_full(ids_B[:, None], position_ids_BT=pos_B[:, None], kv_caches=views)
        return sample(out.logits_BTV[:, -1], sampling, any_filter=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(), step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = replay_ms(graph)
    del graph  # the closure holds the slab until this function returns
    torch.cuda.empty_cache()
    return ms


@torch.no_grad()
def paged_step_ms(model, arch, B: int, S: int, ctx: int, kernel: bool) -> tuple[float, float]:
    """(graph replay ms, whole engine step ms) with B requests decoding at `ctx` positions."""
    engine = Engine(model, EngineConfig(max_batch_size=B, max_seq_len=S, kv_cache_tokens=B * S + 16,
                                        prefill_chunk=min(ctx, 2048), max_prefill_tokens=1 << 16, admit_batch=B,
                                        prefix_caching=False))
    engine.cache.decode_kernel = kernel and engine.cache.decode_kernel
    gen = torch.Generator().manual_seed(0)
    for i in range(B):
        prompt = torch.randint(0, arch.vocab_size, (ctx,), generator=gen).tolist()
        engine.submit(prompt, SamplingParams(max_new_tokens=S - ctx, temperature=1.0, seed=i))
    while engine.stats["decode_steps"] < 3:
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 10
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    graph = next(iter(engine.graphs.captured.values()))[0] if engine.graphs and engine.graphs.captured else None
    ms = replay_ms(graph) if graph is not None else float("nan")
    del engine, graph
    torch.cuda.empty_cache()
    return ms, step_ms


def timings(args) -> None:
    arch = MoEModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, head_dim=args.head_dim, num_experts=args.experts,
                          num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_inter)
    model = build_model(arch, dtype=torch.bfloat16, device="cuda", seed=0).eval()
    B, S = args.batch, args.max_seq_len
    params = sum(p.numel() for p in model.parameters())
    print(f"\ntiming: {params / 1e9:.2f}B-parameter MoE ({args.layers} layers, hidden {args.hidden}, {args.experts} "
          f"experts top-{args.top_k}, heads {args.heads}/{args.kv_heads}x{args.head_dim}), bf16, batch {B}, "
          f"max_seq_len {S}, {torch.cuda.get_device_name()}")
    head = (f"{'context':>8} | {'slab step ms':>12} | {'paged kernel ms':>15} | {'paged gather ms':>15} | "
            f"{'kernel/slab':>11} | {'engine step ms':>14} | {'engine tok/s':>12}")
    print(head)
    print("-" * len(head))
    for ctx in [int(c) for c in args.contexts.split(",")]:
        if ctx >= S:
            print(f"{ctx:>8} | skipped: context must be below max_seq_len")
            continue
        slab = slab_step_ms(model, arch, B, S, ctx)
        kern, step = paged_step_ms(model, arch, B, S, ctx, kernel=True)
        gather = paged_step_ms(model, arch, B, S, ctx, kernel=False)[0] if args.gather else float("nan")
        print(f"{ctx:>8} | {slab:>12.2f} | {kern:>15.2f} | {gather:>15.2f} | {kern / slab:>11.2f} | {step:>14.2f} | "
              f"{B / step * 1e3:>12.0f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-gather", dest="gather", action="store_false", help="skip the gather + SDPA column")
    p.add_argument("--eks", action="store_true", help="only: configs/eks-p5en.toml's engine at the 30B-A3B shape")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-inter", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--contexts", default="128,1024,3072")
    args = p.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    if args.eks:
        failures: list[str] = []
        check_eks_p5en(failures)
        print(f"\n{'FAILED: ' + ', '.join(failures) if failures else 'all checks passed'}")
        return 1 if failures else 0
    timings(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
