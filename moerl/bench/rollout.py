"""`moerl bench rollout`: generation throughput of moerl's engine against transformers' `generate`.

    python -m moerl.cli bench rollout                          # GPU: the 0.92B preset, 256 requests x 128-token
                                                               # prompts x 256 new tokens, greedy, bf16
    python -m moerl.cli bench rollout --preset qwen3-30b-a3b   # Qwen3-30B-A3B's shape, random init, temperature 1
    python -m moerl.cli bench rollout --device cpu             # the tiny demo model on CPU (preset `tiny`)
    python -m moerl.cli bench rollout --ep-size 8              # an engine group over 8 GPUs vs one engine
    python -m moerl.cli bench rollout --profile --overlap-ablation  # + where a step goes in graph mode (host
                                                               # included), and the rate with overlapped decode off

Presets (`PRESETS`) fix the model shape, the workload and the sampling; --requests/--prompt-len/--new-tokens/
--temperature override them. Random weights are drawn on the device itself (no CPU copy, no download). Both
engines run the same weights on the same prompts in one process, with no stop token (every request generates
exactly --new-tokens). transformers runs with its dynamic and its static cache; the faster is the peer (not run
at the 30B shape: a second 61 GB copy of the weights does not fit next to ours). Decode throughput = tokens
generated after each request's first token / time after the last first token. The HBM floor of one decode step
is the bytes of the weights the batch touches (attention, the experts its tokens route to, the router, the
lm_head; embedding rows aside) plus the KV cache at the mean context, over the measured device copy bandwidth;
the table gives the floor as tok/s and our fraction of it. The prefill floor is the FLOPs of every prompt token
(`prefill_flops`) over the measured matmul peak, against the time from submit to the last first token. Beside
the floors, the decode step split (moerl/bench/step_split.py; --no-split skips it): a few eager decode steps
profiled, each kernel put in experts, attention, dense GEMMs, norms, router, dispatch, sampling, other or
unclassified, and the host's share of the timed step."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from moerl.bench import decode_profile, options, step_split
from moerl.bench.common import (Row, device_description, format_table, measure_copy_bandwidth, measure_matmul_peak,
                                synchronize)
from moerl.bench.rollout_ep import main_ep
from moerl.bench.rollout_workload import PRESETS, parameter_count, run_engine, size_label
from moerl.model import MoEModelConfig, build_model
from moerl.model.layers import RMSNorm
from moerl.rollout import Engine, EngineConfig


def random_model(config: MoEModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0, *,
                 draw_on_device: bool | None = None):
    """A random-init model. draw_on_device (default: on CUDA): the weights are drawn by a generator on the
    device (normal(0, initializer_range), norms at one) straight into `dtype` storage: no float32 or CPU copy,
    so the 30B shape needs only its 61 GB. Otherwise `build_model`'s seeded CPU draws (the same weights on
    every machine)."""
    if not (device.type == "cuda" if draw_on_device is None else draw_on_device):
        return build_model(config, dtype=dtype, device=device, seed=seed)
    model = build_model(config, dtype=dtype, device=device, init=False)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, RMSNorm):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, config.initializer_range, generator=gen)
    return model


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("rollout").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def _run_without_overlap(engine: Engine, model, prompts, new_tokens: int, temperature: float) -> dict | None:
    """The timed run again with overlapped decode off (the same engine, graphs and prompts); None where it is off
    already (a CPU's default)."""
    if not engine.pipeline.overlap:
        return None
    engine.pipeline.overlap = False  # between runs: no step is launched ahead now
    try:
        return run_engine(engine, model, prompts, new_tokens, temperature)
    finally:
        engine.pipeline.overlap = True


def _measure_split(engine: Engine, prompts, new_tokens: int, temperature: float):
    """The decode step split, or None with one line saying why (a profiler failure costs the split only)."""
    try:
        return step_split.measure(engine, prompts, new_tokens, temperature)
    except Exception as e:  # noqa: BLE001 - the bench's own numbers still print
        first = str(e).splitlines()[0][:200] if str(e) else ""
        print(f"decode step split failed, skipped: {type(e).__name__}: {first}")
        return None


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


def _run_hf(hf, prompts, new_tokens: int, cache: str, temperature: float) -> dict:
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=device)
    # An explicit all-ones mask: with pad_token_id=0 and no mask, transformers would mask prompt tokens equal to 0.
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(ids))
    if temperature > 0:  # plain sampling, as ours: no top-k (transformers' default is 50), no top-p
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
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


def decode_step_bytes(config: MoEModelConfig, batch: int, context: int, bytes_per: int) -> tuple[float, float]:
    """(weight bytes, KV bytes) one decode step must read from HBM: every weight the batch touches once (the
    attention, the router, the experts its batch x top-k assignments hit, the lm_head; embedding rows aside)
    and the keys/values of `context` positions per request.

    Experts touched per layer: E (1 - (1 - K/E)^batch), the expected number of distinct experts hit by uniform
    routing (a random-init router is close to uniform). It is E for any batch much larger than E/K: all
    experts at 256 requests for both presets; smaller batches read fewer."""
    D, L, E, K = config.hidden_size, config.num_hidden_layers, config.num_experts, config.num_experts_per_tok
    attn = D * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    experts_touched = E * (1 - (1 - K / E) ** batch)
    expert = 3 * D * config.moe_intermediate_size
    weights = L * (attn + experts_touched * expert + E * D) + config.vocab_size * D
    kv = batch * context * L * 2 * config.num_key_value_heads * config.head_dim
    return weights * bytes_per, kv * bytes_per


def prefill_flops(config: MoEModelConfig, prompt_len: int) -> tuple[float, float]:
    """(FLOPs to prefill one prompt, active parameters per token). 2 x the parameters each token multiplies
    (attention projections, the router and top-k experts, or a dense MLP), causal attention's scores and values
    (4 H d per query-key pair, position i sees i + 1 keys) and the lm_head at the last position only (the
    engine prefills with last_logits_only). Norms, rope and softmaxes are left out: under 1% at these shapes."""
    D, H, G, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attn = D * d * (2 * H + 2 * G)
    moe = config.num_experts * D + config.num_experts_per_tok * 3 * D * config.moe_intermediate_size
    dense = 3 * D * config.intermediate_size
    active = sum(attn + (moe if config.is_moe_layer(i) else dense) for i in range(config.num_hidden_layers))
    pairs = prompt_len * (prompt_len + 1) // 2
    flops = 2 * active * prompt_len + config.num_hidden_layers * 4 * H * d * pairs + 2 * config.vocab_size * D
    return float(flops), float(active)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    if args.ep_size > 1:
        return main_ep(args)
    device = _device(args.device)
    gpu = device.type == "cuda"
    name = args.preset or ("0.9b" if gpu else "tiny")
    preset = PRESETS[name]
    R, P, N = args.requests or preset.requests, args.prompt_len or preset.prompt_len, args.new_tokens or preset.new_tokens
    T = preset.temperature if args.temperature is None else args.temperature
    config = preset.config()
    dtype = preset.dtype if gpu else torch.float32
    print(f"rollout [{name}]: building a random-init {size_label(parameter_count(config))}-parameter MoE "
          f"({config.num_hidden_layers} layers, {config.num_experts} experts top-{config.num_experts_per_tok}) "
          f"in {dtype} on {device_description(device)}", flush=True)
    try:
        t0 = time.perf_counter()
        model = random_model(config, dtype, device, seed=0)
        synchronize(device)
        print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, config.vocab_size, (R, P), generator=gen).tolist()
        # No prefix cache: the timed run submits the warm-up's prompts again, which it would find cached.
        engine = Engine(model, EngineConfig(max_batch_size=R, max_seq_len=P + N, prefill_chunk=P,
                                            max_prefill_tokens=1 << 20, cuda_graphs=not args.no_graphs,
                                            prefix_caching=False))
        print(f"{R} requests x {P}-token prompts x {N} new tokens, temperature {T}; warming up "
              f"(compiles, captures the {R}-row decode graph)", flush=True)
        run_engine(engine, model, prompts, 4, T)  # Triton compiles; the graph of the timed run's batch captured
        ours = run_engine(engine, model, prompts, N, T)
        no_overlap = _run_without_overlap(engine, model, prompts, N, T) if args.overlap_ablation else None
        if args.profile:
            decode_profile.profile_decode(engine, prompts, T, N, trace=args.trace)
        split = None if args.no_split else _measure_split(engine, prompts, N, T)
    except torch.OutOfMemoryError as e:
        free, total = torch.cuda.mem_get_info(device) if gpu else (0, 0)
        print(f"out of device memory at preset {name} with {R} requests x {P + N} positions: "
              f"{str(e).splitlines()[0][:200]} (free {free / 2**30:.1f} of {total / 2**30:.1f} GiB); "
              "try fewer --requests", file=sys.stderr)
        return 1
    print(f"moerl: {ours['total_s']:.2f}s total, mean TTFT {ours['ttft_s'] * 1e3:.1f} ms, "
          f"{ours['decode_tok_s']:.0f} decode tok/s, CUDA graphs: {ours['graphs']}", flush=True)
    if no_overlap is not None:
        print(f"overlapped decode off: {no_overlap['decode_tok_s']:.0f} decode tok/s; with it "
              f"{ours['decode_tok_s'] / no_overlap['decode_tok_s']:.3f}x that (one run each)", flush=True)
    elif args.overlap_ablation:
        print("overlapped decode is off on this device already (EngineConfig.overlap_decode): no ablation")
    peer, peer_name = None, "-"
    peer_spec = args.peer if args.peer is not None else ("dynamic,static" if preset.peer else "none")
    caches = [c for c in peer_spec.split(",") if c and c != "none"]
    if caches:
        try:
            hf = _hf_model(model)
        except ImportError:
            hf, caches = None, []
            print("transformers is not installed: no peer column")
        for cache in caches:
            try:
                res = _run_hf(hf, prompts, N, cache, T)
            except Exception as e:  # noqa: BLE001 - report the peer's failure, keep our numbers
                print(f"transformers generate ({cache} cache) failed: {str(e).splitlines()[0][:160]}")
                continue
            print(f"transformers ({cache} cache): {res['total_s']:.2f}s total, TTFT {res['ttft_s'] * 1e3:.1f} ms, "
                  f"{res['decode_tok_s']:.0f} decode tok/s")
            if peer is None or res["decode_tok_s"] > peer["decode_tok_s"]:
                peer, peer_name = res, cache
    copy_bw = measure_copy_bandwidth(device)
    prefill, active = prefill_flops(config, P)
    prefill_floor_s = R * prefill / measure_matmul_peak(device, dtype)
    step_s = 1.0 / (ours["decode_tok_s"] / R)
    weight_bytes, kv_bytes = decode_step_bytes(config, R, P + N // 2, torch.finfo(dtype).bits // 8)
    floor_s = (weight_bytes + kv_bytes) / copy_bw
    peak_bw = args.peak_bw * 1e9 if args.peak_bw else (4.8e12 if gpu and "H200" in torch.cuda.get_device_name(device)
                                                        else None)
    rows = [
        Row("decode throughput", ours["decode_tok_s"], peer["decode_tok_s"] if peer else None, "tok/s",
            ceiling=R / floor_s),
        Row("HBM floor (decode)", R / floor_s, None, "tok/s"),
        Row("end-to-end throughput", R * N / ours["total_s"], R * N / peer["total_s"] if peer else None, "tok/s"),
        Row("prefill, all prompts", R * P / ours["all_first_s"], R * P / peer["ttft_s"] if peer else None, "tok/s",
            ceiling=R * P / prefill_floor_s),
        Row("mean time to first token", ours["ttft_s"] * 1e3, peer["ttft_s"] * 1e3 if peer else None, "ms",
            higher_is_better=False),
        Row("decode step", step_s * 1e3, None, "ms"),
    ]
    if no_overlap is not None:
        rows.insert(1, Row("decode throughput, overlapped decode off", no_overlap["decode_tok_s"], None, "tok/s",
                           ceiling=R / floor_s))
    if peer is not None:
        title = f"peer: transformers generate, {peer_name} cache, grouped_mm experts"
    else:
        title = "peer: none" + (f" ({preset.note})" if not preset.peer and args.peer is None else "")
    print(format_table(f"\nrollout [{name}], temperature {T} ({title})", rows, peer_name="transformers"))
    print(f"hw limit: HBM floor of a decode step {floor_s * 1e3:.3f} ms = {weight_bytes / 1e9:.3g} GB of weights "
          f"touched + {kv_bytes / 1e9:.3g} GB of KV at the mean context {P + N // 2}, over the measured copy "
          f"bandwidth {copy_bw / 1e9:.0f} GB/s; ours is {floor_s / step_s * 100:.1f}% of it")
    if peak_bw:
        peak_floor_s = (weight_bytes + kv_bytes) / peak_bw
        print(f"at the datasheet {peak_bw / 1e12:.1f} TB/s: floor {R / peak_floor_s:,.0f} tok/s "
              f"({peak_floor_s * 1e3:.3f} ms/step); ours is {peak_floor_s / step_s * 100:.1f}% of it")
    print(f"prefill floor: {R} x {P} prompt tokens x {prefill / P / 1e9:.3g} GFLOP/token (2 x {size_label(active)} "
          f"active parameters, causal attention, lm_head at the last position) = {R * prefill / 1e12:.3g} TFLOP over "
          f"the measured matmul peak {R * prefill / prefill_floor_s / 1e12:.3g} TFLOP/s: "
          f"{prefill_floor_s * 1e3:.3g} ms; "
          f"ours from submit to the last first token {ours['all_first_s'] * 1e3:.1f} ms "
          f"({prefill_floor_s / ours['all_first_s'] * 100:.1f}% of the floor's speed), "
          f"mean TTFT {ours['ttft_s'] * 1e3:.1f} ms")
    if split is not None:
        print(step_split.format_split(split, step_s * 1e3, ours["graphs"]))
    if peer is not None and T == 0:
        # Greedy outputs should agree; in bf16 a near-tie can flip a token and with it the rest of a sequence.
        same = sum(a == b for a, b in zip(ours["tokens"], peer["tokens"]))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(ours["tokens"], peer["tokens"])]
        print(f"greedy agreement with transformers: {same}/{R} sequences identical; mean identical prefix "
              f"{sum(prefix) / R:.1f} of {N} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
