"""`moerl bench rollout --ep-size N`: an engine group over N ranks (experts split, attention data-parallel)
against one engine on one device, on the same workload in the same run.

    moerl bench rollout --ep-size 2 --device cpu                           # 2 gloo ranks, the tiny preset
    moerl bench rollout --ep-size 8 --preset qwen3-30b-a3b                 # spawns 8 ranks on this host's GPUs
    torchrun --nproc-per-node=8 -m moerl.cli bench rollout --ep-size 8 --preset qwen3-30b-a3b

The R requests (the preset's, or --requests) are dealt round-robin to the ranks (R/N each, the engine group's
data-parallel attention); every rank runs `EngineGroup` (moerl/rollout/engine_group.py) over its share, with
the all_to_all dispatcher and no CUDA graphs. The peer is one `Engine` with all R requests on rank 0's device
(CUDA graphs as configured), run first while the other ranks wait; `--peer none` skips it (a model that does
not fit one device). Decode throughput = tokens after each request's first token / time after the last first
token on any rank. Random weights are drawn by `build_model` (the same on every rank, each keeps its experts).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from moerl.bench.common import Row, device_description, format_table, synchronize
from moerl.bench.ranks import init_rank, spawn_ranks
from moerl.bench.rollout_workload import PRESETS, parameter_count, run_engine, size_label
from moerl.model import build_model
from moerl.rollout import Engine, EngineConfig, EngineGroup, SamplingParams


def main_ep(args) -> int:
    """`moerl bench rollout` with --ep-size > 1 (args parsed by moerl/bench/rollout.py)."""
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        if int(os.environ["WORLD_SIZE"]) != args.ep_size:
            print(f"error: --ep-size {args.ep_size} but torchrun started {os.environ['WORLD_SIZE']} ranks")
            return 2
        text = run_rank(int(os.environ["RANK"]), args.ep_size, None, args)
        if text is not None:
            print(text)
        return 0
    if args.device == "cuda" and args.ep_size > torch.cuda.device_count():
        print(f"error: --ep-size {args.ep_size} but only {torch.cuda.device_count()} GPUs")
        return 2
    ok, text = spawn_ranks(args.ep_size, run_rank, args, timeout_s=3600.0)
    print(text)
    return 0 if ok else 1


def run_rank(rank: int, world: int, port: int | None, args) -> str | None:
    device = init_rank(rank, world, port, args.device)
    try:
        return bench_rank(rank, world, device, args)
    finally:
        dist.destroy_process_group()


def bench_rank(rank: int, world: int, device: torch.device, args) -> str | None:
    """One rank's part (the group already formed); rank 0 returns the report."""
    name = args.preset or ("0.9b" if device.type == "cuda" else "tiny")
    preset = PRESETS[name]
    R, P = args.requests or preset.requests, args.prompt_len or preset.prompt_len
    N = args.new_tokens or preset.new_tokens
    T = preset.temperature if args.temperature is None else args.temperature
    config, dtype = preset.config(), preset.dtype if device.type == "cuda" else torch.float32
    if config.num_experts % world:
        raise ValueError(f"--ep-size {world} does not divide the {config.num_experts} experts of preset {name}")
    prompts = torch.randint(0, config.vocab_size, (R, P), generator=torch.Generator().manual_seed(0)).tolist()
    engine_config = dict(max_seq_len=P + N, prefill_chunk=P, max_prefill_tokens=1 << 20, prefix_caching=False)
    peer = None
    if rank == 0 and args.peer != "none":  # one engine, every request, before the group's model exists
        model = build_model(config, dtype=dtype, device=device, seed=0)
        engine = Engine(model, EngineConfig(max_batch_size=R, cuda_graphs=not args.no_graphs, **engine_config))
        run_engine(engine, model, prompts, 4, T)  # warm-up
        peer = run_engine(engine, model, prompts, N, T)
        del engine, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    mine = prompts[rank::world]
    model = build_model(config, dtype=dtype, device=device, seed=0, expert_parallel_group=dist.group.WORLD,
                        dispatcher="all_to_all")
    group = EngineGroup(model, EngineConfig(max_batch_size=max(1, len(mine)), **engine_config))
    _run_group(group, mine, 4, T, device)  # warm-up
    ours = _run_group(group, mine, N, T, device)
    ours["empty_forwards"] = group.stats["empty_forwards"]
    ours["decode_steps"] = group.stats["decode_steps"]
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(ours, gathered, dst=0)
    if rank != 0:
        return None
    return _report(name, dtype, device, world, R, P, N, T, gathered, peer, size_label(parameter_count(config)))


def _run_group(group: EngineGroup, prompts, new_tokens: int, temperature: float, device) -> dict:
    """This rank's requests to completion, timed from a common start (a barrier)."""
    ids = [group.submit(p, SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=i))
           for i, p in enumerate(prompts)]
    first: dict[str, float] = {}
    generated = 0
    synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    while group.any_unfinished():
        for out in group.step():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            generated += len(out.new_token_ids)
    synchronize(device)
    return {"total_s": time.perf_counter() - t0, "first_s": list(first.values()), "generated": generated,
            "requests": len(ids)}


def _report(name, dtype, device, world, R, P, N, T, ranks: list[dict], peer: dict | None, params: str) -> str:
    total = max(r["total_s"] for r in ranks)
    firsts = [f for r in ranks for f in r["first_s"]]
    generated = sum(r["generated"] for r in ranks)
    decode_tok_s = (generated - R) / (total - max(firsts))
    steps = max(r["decode_steps"] for r in ranks)
    rows = [
        Row("decode throughput", decode_tok_s, peer["decode_tok_s"] if peer else None, "tok/s"),
        Row("end-to-end throughput", R * N / total, R * N / peer["total_s"] if peer else None, "tok/s"),
        Row("mean time to first token", sum(firsts) / len(firsts) * 1e3, peer["ttft_s"] * 1e3 if peer else None,
            "ms", higher_is_better=False),
    ]
    head = (f"rollout [{name}] over {world} ranks (expert parallel, all_to_all, no CUDA graphs) on "
            f"{device_description(device)}: {params} parameters in {dtype}, {R} requests x {P}-token "
            f"prompts x {N} new tokens, temperature {T}; peer: " +
            ("one engine on rank 0's device" if peer else "none (--peer none)"))
    tail = (f"per rank: requests {[r['requests'] for r in ranks]}, empty forwards "
            f"{[r['empty_forwards'] for r in ranks]} (over about {steps} decode steps, warm-up included)")
    return "\n".join([head, format_table("", rows, peer_name="one engine"), tail])
