"""Check the paged decode path on a GPU, and time it against the slab cache it replaced.

    python scripts/gpu/paged_decode_check.py                       # small model: checks, then timings
    python scripts/gpu/paged_decode_check.py --layers 8 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128 \
        --experts 128 --top-k 8 --moe-inter 768 --vocab 151936 --batch 256 --max-seq-len 5120 \
        --contexts 256,1024,4096                                   # 30B-A3B's layer shape, 8 of its 48 layers
    TRITON_INTERPRET=1 python scripts/gpu/paged_decode_check.py --kernel-only --device cpu   # no GPU: interpreter
    python scripts/gpu/paged_decode_check.py --eks                 # eks-p5en's rollout engine, 30B-A3B shape

1. kernel: the Triton paged decode kernel against the torch reference computed in float64, with float64,
   float32 and bfloat16 inputs, for several block sizes, GQA ratios and row lengths (1 to the table's full
   width); on CUDA also replayed in a CUDA graph after its block tables and lengths changed.
2. engine: a float32 tiny model generates on the GPU with the paged kernel, eagerly (float32's MoE loop reads
   expert counts on the host, so it cannot be captured): greedy tokens equal to a plain loop of full forwards,
   log-probs within 1e-4 of a full forward, routing equal; the same model in bf16 with CUDA graphs: every graph
   captured, completions equal to the eager engine's (log-probs within 5e-2).
3. timing, per context length (every request holding that many positions): one decode step replayed from its
   CUDA graph for (a) the slab decode the engine captured before (a [B, G, max_seq_len + 1, d] slab per layer,
   masked attention over the whole slab), (b) the paged engine with the Triton kernel, (c) the paged engine
   gathering blocks + SDPA (its fallback without triton); and the paged engine's whole step() (host work
   included), as decode tokens per second. Random-init weights, temperature 1.
4. --eks (alone): configs/eks-p5en.toml's rollout engine (256 x 5120) starts at Qwen3-30B-A3B's shape and runs a
   GRPO-like load of 16 groups x 16 samples.
Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a source tree, moerl not installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moerl.kernels import paged_decode_reference  # noqa: E402
from moerl.model import MoEModelConfig, build_model  # noqa: E402
from moerl.rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from moerl.rollout.sampling import SamplingBatch, sample  # noqa: E402

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}


def check_kernel(device: str, failures: list[str]) -> None:
    from moerl.kernels.triton_paged import paged_decode

    gen = torch.Generator().manual_seed(0)
    for B, H, G, d, P, W in [(5, 32, 4, 128, 16, 12), (3, 8, 8, 64, 32, 5), (4, 16, 2, 96, 4, 20), (1, 4, 1, 8, 16, 3)]:
        N = B * W + 3
        q = torch.randn(B, H, d, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(N, G, P, d, generator=gen, dtype=torch.float64) for _ in range(2))
        table = torch.randperm(N - 1, generator=gen)[: B * W].view(B, W) + 1
        seq = torch.randint(1, W * P + 1, (B,), generator=gen)
        seq[0], seq[-1] = 1, W * P
        want = paged_decode_reference(q, k, v, table, seq)
        # Triton's interpreter computes bf16 dots wrong (a 16x16 bf16 tl.dot is off by 1e10 there): GPU only.
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        for dtype in (torch.float64, torch.float32) + (() if interpreted else (torch.bfloat16,)):
            args = [x.to(device=device, dtype=dtype) for x in (q, k, v)] + [table.to(device), seq.to(device)]
            try:
                got = paged_decode(*args)
            except Exception as e:  # noqa: BLE001 - report and go on (float64 dot needs sm80+)
                print(f"FAIL kernel B={B} H={H} G={G} d={d} P={P} {dtype}: {type(e).__name__}: {str(e)[:200]}")
                failures.append(f"kernel {dtype}")
                continue
            err = (got.double().cpu() - want).abs().max().item()
            ok = err <= TOL[dtype]
            shape = f"B={B} H={H} G={G} d={d} P={P} W={W}"
            print(f"{'PASS' if ok else 'FAIL'} kernel {shape} {dtype}: max abs err {err:.1e}")
            if not ok:
                failures.append(f"kernel {dtype} P={P}")
        if device == "cuda":  # in a CUDA graph, with new tables and lengths written into the captured buffers
            args = [x.to(device=device, dtype=torch.float32) for x in (q, k, v)] + [table.cuda(), seq.cuda()]
            paged_decode(*args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = paged_decode(*args)
            new_table, new_seq = table.flip(0), torch.randint(1, W * P + 1, (B,), generator=gen)
            args[3].copy_(new_table)
            args[4].copy_(new_seq)
            graph.replay()
            err = (out.double().cpu() - paged_decode_reference(q, k, v, new_table, new_seq)).abs().max().item()
            ok = err <= TOL[torch.float32]
            print(f"{'PASS' if ok else 'FAIL'} kernel in a CUDA graph, new table and lengths: max abs err {err:.1e}")
            if not ok:
                failures.append("kernel in graph")


@torch.no_grad()
def check_engine(failures: list[str]) -> None:
    arch = MoEModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                          num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1], initializer_range=0.1)
    model = build_model(arch, device="cuda", seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (1, 5, 11, 16, 17, 33)] * 2
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    # float32 decodes eagerly on a GPU: its MoE takes the per-expert loop (torch._grouped_mm is bf16-only there),
    # which reads the expert counts on the host, so float32 checks exactness and bf16 below checks the graphs.
    for block in (16, 4):
        engine = Engine(model, EngineConfig(max_batch_size=4, max_seq_len=64, kv_block_size=block,
                                            cuda_graphs=False, prefill_chunk=7))
        outs = engine.generate(prompts, params)
        worst, bad = 0.0, []
        for prompt, c in zip(prompts, outs):
            tokens = list(prompt)
            for _ in range(20):
                tokens.append(int(model(torch.tensor([tokens], device="cuda"))[0, -1].argmax()))
            full = model.forward_full(torch.tensor([tokens[:-1]], device="cuda"))
            logp = torch.log_softmax(full.logits_BTV[0, len(prompt) - 1:].float(), -1)
            logp = logp.gather(1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0].cpu()
            worst = max(worst, (logp - torch.tensor(c.logprobs)).abs().max().item())
            if c.token_ids != tokens[len(prompt):] or not torch.equal(c.routed_experts.long(),
                                                                     full.routed_experts_BTLK[0].cpu()):
                bad.append(len(prompt))
        kernel = engine.cache.decode_kernel
        ok = not bad and worst <= 1e-4 and kernel
        print(f"{'PASS' if ok else 'FAIL'} engine float32 block={block} paged kernel={kernel}: tokens/routing "
              f"differ for prompt lengths {bad}, max |log-prob - full forward| {worst:.1e}, "
              f"{engine.stats['prefix_hit_tokens']} prefix-cache tokens")
        if not ok:
            failures.append(f"engine float32 block={block}")
    # bf16 with CUDA graphs: every bucket captured, and the replayed steps give the eager engine's log-probs
    # (same kernels; bucket padding may change a GEMM's reduction order, hence a tolerance, not equality).
    model16 = build_model(arch, device="cuda", seed=0, dtype=torch.bfloat16).eval()
    runs = {}
    for graphs in (True, False):
        engine = Engine(model16, EngineConfig(max_batch_size=4, max_seq_len=64, kv_block_size=16,
                                              cuda_graphs=graphs, prefill_chunk=7))
        runs[graphs] = (engine, engine.generate(prompts, params))
    (engine, outs), (_, eager) = runs[True], runs[False]
    same = [a.token_ids == b.token_ids for a, b in zip(outs, eager)]
    diff = max((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item()
               for a, b, s in zip(outs, eager, same) if s) if any(same) else float("inf")
    ok = engine.graphs.disabled_reason is None and bool(engine.graphs.captured) and sum(same) >= len(same) - 2 \
        and diff <= 5e-2
    print(f"{'PASS' if ok else 'FAIL'} engine bfloat16 graphs: captured {len(engine.graphs.captured)} graphs "
          f"(failure: {engine.graphs.disabled_reason}), {sum(same)}/{len(same)} completions equal to eager, "
          f"max |log-prob diff| on those {diff:.1e}")
    if not ok:
        failures.append("engine bf16 graphs")


@torch.no_grad()
def check_eks_p5en(failures: list[str]) -> None:
    """configs/eks-p5en.toml's rollout settings (256 x 5120) at Qwen3-30B-A3B's shape (random weights) on this
    GPU: the plan before the weights load, the engine starting, and a GRPO-like load (16 groups of 16 samples,
    1,000-token prompts, 1,024 new tokens at temperature 1: the groups share their prompts' blocks)."""
    from moerl.bench.rollout import qwen3_30b_a3b_config, random_model
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
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernel-only", action="store_true")
    p.add_argument("--no-timing", action="store_true")
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
    failures: list[str] = []
    if args.eks:
        check_eks_p5en(failures)
        print(f"\n{'FAILED: ' + ', '.join(failures) if failures else 'all checks passed'}")
        return 1 if failures else 0
    check_kernel(args.device, failures)
    if not args.kernel_only:
        assert torch.cuda.is_available(), "the engine checks and timings need a CUDA device"
        check_engine(failures)
        if not args.no_timing:
            timings(args)
    print(f"\n{'FAILED: ' + ', '.join(failures) if failures else 'all checks passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
