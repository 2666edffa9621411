"""`moerl bench rollout`: generation throughput of moerl's engine against transformers' `generate`.

    python -m moerl.cli bench rollout                  # GPU: 256 requests x 128-token prompts x 256 new tokens,
                                                       # a random-init ~1B-parameter Qwen3-MoE, bf16
    python -m moerl.cli bench rollout --device cpu     # the tiny demo model on CPU

Both run the same weights on the same prompts in one process, greedy, with no stop token (every request
generates exactly --new-tokens). transformers runs with its dynamic cache and its static cache; the faster
is the peer. Decode throughput = tokens generated after each request's first token / time after the last
first token. The HBM floor of one decode step is the bytes of the weights the batch touches (attention, the
experts its tokens route to, embeddings row reads aside, lm_head) plus the KV cache read, over the measured
device copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from moerl.bench.common import Row, device_description, format_table, measure_copy_bandwidth, synchronize
from moerl.model import MoEModelConfig, build_model, tiny_config
from moerl.rollout import Engine, EngineConfig, SamplingParams


def bench_model_config() -> MoEModelConfig:
    """About 1B parameters: hidden 1024, 16 layers, 64 experts top-8, expert intermediate 256."""
    return MoEModelConfig(vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                          num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                          num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True,
                          max_position_embeddings=4096)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moerl bench rollout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--requests", type=int, default=None, help="GPU 256, CPU 16")
    p.add_argument("--prompt-len", type=int, default=None, help="GPU 128, CPU 16")
    p.add_argument("--new-tokens", type=int, default=None, help="GPU 256, CPU 32")
    p.add_argument("--peer", default="dynamic,static", help="transformers cache implementations, or 'none'")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    p.add_argument("--profile", action="store_true", help="print the top ops of 5 decode steps")
    return p.parse_args(argv)


def _run_engine(engine: Engine, model, prompts, new_tokens: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    device = next(model.parameters()).device
    synchronize(device)
    t0 = time.perf_counter()
    for p in prompts:
        engine.submit(p, params)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    generated = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now - t0
            generated += len(out.new_token_ids)
            if out.completion is not None:
                tokens[out.request_id] = out.completion.token_ids
    total = time.perf_counter() - t0
    all_first = max(first.values())
    return {"total_s": total, "ttft_s": sum(first.values()) / len(first), "all_first_s": all_first,
            "decode_tok_s": (generated - len(prompts)) / (total - all_first), "generated": generated,
            "decode_steps": engine.stats["decode_steps"], "tokens": [tokens[k] for k in sorted(tokens, key=lambda r: int(r.split("-")[1]))],
            "graphs": engine.graphs is not None and
            engine.graphs.disabled_reason is None}


def _profile_decode(engine: Engine, prompts, device) -> None:
    from torch.profiler import ProfilerActivity, profile

    for p in prompts:
        engine.submit(p, SamplingParams(max_new_tokens=64, temperature=0.0))
    for _ in range(3):
        engine.step()  # prefill, then steady decode
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(5):
            engine.step()
        synchronize(device)
    print(f"--- profile of 5 decode steps: {(time.perf_counter() - t0) / 5 * 1e3:.2f} ms/step wall (profiler on)")
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=50))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
    while engine.has_unfinished():
        engine.step()


def _hf_model(model, impl: str = "grouped_mm"):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = {k: v for k, v in model.config.to_hf_dict().items() if k not in ("architectures", "model_type")}
    hf_config = Qwen3MoeConfig(**cfg)
    hf_config._experts_implementation = impl
    param = next(model.parameters())
    with torch.device(param.device):
        hf = Qwen3MoeForCausalLM(hf_config).to(param.dtype).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("expert_bias")}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf


def _run_hf(hf, prompts, new_tokens: int, cache: str) -> dict:
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=device)
    # An explicit all-ones mask: with pad_token_id=0 and no mask, transformers would mask prompt tokens equal to 0.
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(ids))
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        hf.generate(ids[:2], max_new_tokens=4, min_new_tokens=4,
                    **{**kwargs, "attention_mask": kwargs["attention_mask"][:2]})  # warm-up
        synchronize(device)
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        synchronize(device)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        synchronize(device)
        total = time.perf_counter() - t0
    return {"total_s": total, "ttft_s": ttft, "decode_tok_s": len(prompts) * (new_tokens - 1) / (total - ttft),
            "tokens": out[:, ids.shape[1]:].tolist()}


def _floor_step_s(config: MoEModelConfig, batch: int, context: int, bytes_per: int, copy_bw: float) -> float:
    """HBM bytes of one decode step (weights touched once, KV read once) over the copy bandwidth."""
    D, L, E, K = config.hidden_size, config.num_hidden_layers, config.num_experts, config.num_experts_per_tok
    attn = D * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    experts_touched = E * (1 - (1 - K / E) ** batch)  # expected distinct experts per layer
    expert = 3 * D * config.moe_intermediate_size
    weights = L * (attn + experts_touched * expert + E * D) + config.vocab_size * D
    kv = batch * context * L * 2 * config.num_key_value_heads * config.head_dim
    return (weights + kv) * bytes_per / copy_bw


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    gpu = device.type == "cuda"
    R = args.requests or (256 if gpu else 16)
    P = args.prompt_len or (128 if gpu else 16)
    N = args.new_tokens or (256 if gpu else 32)
    config = bench_model_config() if gpu else tiny_config()
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.set_num_threads(torch.get_num_threads())
    model = build_model(config, dtype=dtype, device=device, seed=0)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (R, P), generator=gen).tolist()
    print(f"rollout: {R} requests x {P}-token prompts x {N} new tokens, {params / 1e9:.2f}B-parameter MoE "
          f"({config.num_experts} experts top-{config.num_experts_per_tok}), {dtype}, {device_description(device)}")
    engine = Engine(model, EngineConfig(max_batch_size=R, max_seq_len=P + N, prefill_chunk=P,
                                        max_prefill_tokens=1 << 20, cuda_graphs=not args.no_graphs))
    # Warm-up on the same engine at full batch: Triton compiles, CUDA-graph buckets up to R are captured.
    _run_engine(engine, model, prompts, 4)
    ours = _run_engine(engine, model, prompts, N)
    if args.profile:
        _profile_decode(engine, prompts, device)
    print(f"moerl: {ours['total_s']:.2f}s total, mean TTFT {ours['ttft_s'] * 1e3:.1f} ms, "
          f"{ours['decode_tok_s']:.0f} decode tok/s, CUDA graphs: {ours['graphs']}")
    peer, peer_name = None, "-"
    caches = [c for c in args.peer.split(",") if c and c != "none"]
    if caches:
        try:
            hf = _hf_model(model)
        except ImportError:
            hf, caches = None, []
            print("transformers is not installed: no peer column")
        for cache in caches:
            try:
                res = _run_hf(hf, prompts, N, cache)
            except Exception as e:  # noqa: BLE001 - report the peer's failure, keep our numbers
                print(f"transformers generate ({cache} cache) failed: {str(e).splitlines()[0][:160]}")
                continue
            print(f"transformers ({cache} cache): {res['total_s']:.2f}s total, TTFT {res['ttft_s'] * 1e3:.1f} ms, "
                  f"{res['decode_tok_s']:.0f} decode tok/s")
            if peer is None or res["decode_tok_s"] > peer["decode_tok_s"]:
                peer, peer_name = res, cache
    copy_bw = measure_copy_bandwidth(device)
    step_s = 1.0 / (ours["decode_tok_s"] / R)
    floor_s = _floor_step_s(config, R, P + N // 2, 2 if gpu else 4, copy_bw)
    rows = [
        Row("decode throughput", ours["decode_tok_s"], peer["decode_tok_s"] if peer else None, "tok/s",
            ceiling=R / floor_s),
        Row("end-to-end throughput", R * N / ours["total_s"], R * N / peer["total_s"] if peer else None, "tok/s"),
        Row("mean time to first token", ours["ttft_s"] * 1e3, peer["ttft_s"] * 1e3 if peer else None, "ms",
            higher_is_better=False),
        Row("decode step", step_s * 1e3, None, "ms", ceiling=None),
    ]
    print(format_table(f"\nrollout (peer: transformers generate, {peer_name} cache, grouped_mm experts)", rows,
                       peer_name="transformers"))
    print(f"hw limit: HBM floor of a decode step {floor_s * 1e3:.3f} ms (weights touched + KV at mean context, "
          f"over the measured copy bandwidth {copy_bw / 1e9:.0f} GB/s); ours is {floor_s / step_s * 100:.1f}% of it")
    if peer is not None:
        # Greedy outputs should agree; in bf16 a near-tie can flip a token and with it the rest of a sequence.
        same = sum(a == b for a, b in zip(ours["tokens"], peer["tokens"]))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(ours["tokens"], peer["tokens"])]
        print(f"greedy agreement with transformers: {same}/{R} sequences identical; mean identical prefix "
              f"{sum(prefix) / R:.1f} of {N} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
