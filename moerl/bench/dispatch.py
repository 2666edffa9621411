"""`moerl bench dispatch`: expert-parallel dispatch and combine, each backend against all_to_all.

    moerl bench dispatch                                   # CPU: 2 gloo ranks, scaled-down shapes
    moerl bench dispatch --device cuda --experts 16        # one GPU (world size 1), symm_mem and all_to_all
    torchrun --nproc-per-node=8 -m moerl.cli bench dispatch --experts 128

Per backend, dispatch and combine are timed separately (median over --iters, the slowest rank's median):
latency, and GB/s of payload = tokens x topk x hidden x bytes per element per rank (the DeepEP convention).
The peer is the all_to_all backend (NCCL or gloo all_to_all_single) on the same inputs in the same run.
Routing: uniform random top-k without replacement per token; random activations.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from moerl.bench import options
from moerl.bench.common import Row, device_description, format_table, measure_copy_bandwidth, time_fn
from moerl.bench.ranks import init_rank, spawn_ranks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_HIDDEN, CPU_TOKENS = 1024, "512,128"


def parse_args(argv: list[str]) -> argparse.Namespace:
    return options.parser("dispatch").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available")
        return 2
    notes = []
    if args.device == "cpu" and args.hidden is None and args.tokens is None:
        notes.append(f"CPU: scaled-down default shapes (hidden {CPU_HIDDEN}, tokens {CPU_TOKENS}); "
                     "pass --hidden/--tokens to choose")
    if args.hidden is None:
        args.hidden = CPU_HIDDEN if args.device == "cpu" else 7168
    if args.tokens is None:
        args.tokens = CPU_TOKENS if args.device == "cpu" else "4096,128"
    args.tokens = [int(t) for t in str(args.tokens).split(",") if t]
    if any(t <= 0 for t in args.tokens) or args.topk > args.experts:
        print("error: --tokens must be positive and --topk <= --experts")
        return 2
    if args.backend == "symm_mem":
        from moerl.ep.symm_mem import symm_mem_unavailable_reason

        reason = "it needs CUDA devices (--device cpu)" if args.device == "cpu" else symm_mem_unavailable_reason()
        if reason:
            print(f"error: symm_mem cannot run here: {reason}")
            return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        text = _run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
        if text is not None:
            print("\n".join(notes + [text]))
        return 0
    world = args.world_size or (2 if args.device == "cpu" else torch.cuda.device_count())
    if args.device == "cuda" and world > torch.cuda.device_count():
        print(f"error: --world-size {world} but only {torch.cuda.device_count()} GPUs")
        return 2
    ok, text = spawn_ranks(world, _run_rank, args, args.timeout)
    print("\n".join(notes + [text]))
    return 0 if ok else 1


def _run_rank(rank: int, world: int, port: int | None, args) -> str | None:
    """One rank of the benchmark; returns rank 0's report (None on the other ranks)."""
    device = init_rank(rank, world, port, args.device)
    try:
        return _bench(rank, world, device, args)
    finally:
        dist.destroy_process_group()


def _bench(rank: int, world: int, device: torch.device, args) -> str | None:
    from moerl.ep import make_dispatcher

    E, K, D, dtype, group = args.experts, args.topk, args.hidden, DTYPES[args.dtype], dist.group.WORLD
    if E % world:
        raise ValueError(f"--experts {E} is not divisible by the world size {world}")
    disps, notes = {"all_to_all": make_dispatcher("all_to_all", E, group)}, []
    if args.backend in ("symm_mem", "all"):
        from moerl.ep.symm_mem import symm_mem_unavailable_reason

        reason = symm_mem_unavailable_reason(group, E)
        if reason is None:
            disps["symm_mem"] = make_dispatcher("symm_mem", E, group)
        else:
            notes.append(f"symm_mem not measured: {reason}" + (
                f" (it needs <= 16 experts per rank: --experts {16 * world})" if "experts per rank" in reason else ""))
            if args.backend == "symm_mem":
                raise RuntimeError(notes[-1])
    if args.backend == "symm_mem":
        notes.append("all_to_all is measured as the peer")
    # Hardware limit, measured by rank 0 alone (the only one that reports; on CPU the ranks share the
    # memory bandwidth). Several GPUs: the limit is NVLink, not measured here.
    ceiling = measure_copy_bandwidth(device) / 1e9 if rank == 0 and (device.type == "cpu" or world == 1) else None
    peer_name = f"all_to_all ({'gloo' if device.type == 'cpu' else 'NCCL'})"
    tables = []
    for T in args.tokens:
        gen = torch.Generator().manual_seed(1000 * rank + T)
        x = torch.randn(T, D, generator=gen).to(device, dtype)
        idx = torch.rand(T, E, generator=gen).argsort(-1)[:, :K].to(device)  # uniform, no repeats
        w = torch.softmax(torch.randn(T, K, generator=gen), -1).to(device, dtype)
        payload = T * K * D * x.element_size()
        res = {}
        for name, disp in disps.items():
            if name == "symm_mem":
                disp.max_tokens = T  # fixed capacity: no per-call agreement (the training setting)
            with torch.no_grad():
                t_dispatch = time_fn(lambda: disp.dispatch(x, idx, w), device, warmup=args.warmup, iters=args.iters)
                x_ND, _, handle = disp.dispatch(x, idx, w)
                t_combine = time_fn(lambda: disp.combine(x_ND, handle), device, warmup=args.warmup, iters=args.iters)
            t = torch.tensor([t_dispatch, t_combine], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets the pace
            res[name] = t.tolist()
        rows = []
        for name, (td, tc) in res.items():
            pd, pc = res["all_to_all"]
            for phase, ours, peer in (("dispatch", td, pd), ("combine", tc, pc)):
                rows.append(Row(f"{name} {phase} latency", ours * 1e3, peer * 1e3, "ms", higher_is_better=False))
                rows.append(Row(f"{name} {phase} bandwidth", payload / ours / 1e9, payload / peer / 1e9, "GB/s",
                                ceiling=ceiling))
        title = (f"dispatch/combine: {T} tokens/rank x top-{K}, hidden {D}, {E} experts, {args.dtype}, "
                 f"world size {world}, {device_description(device)}")
        tables.append(format_table(title, rows, peer_name))
    if rank != 0:
        return None
    foot = [f"payload = tokens x topk x hidden x {torch.finfo(dtype).bits // 8} B per rank and direction; "
            "ratio > 1 means faster than the peer; latency = slowest rank's median"]
    if ceiling and device.type == "cpu":
        foot.append(f"of hw limit: measured memcpy bandwidth ({ceiling:.3g} GB/s, bytes read + written). "
                    "On CPU with gloo these numbers show the shape of the costs only.")
    elif ceiling:
        foot.append(f"of hw limit: measured device copy bandwidth ({ceiling:.4g} GB/s, bytes read + written)")
    else:
        foot.append("of hw limit: not shown (NVLink bandwidth is not measured here)")
    if "symm_mem" in disps:
        foot.append("symm_mem runs with max_tokens = tokens/rank (fixed capacity, no per-call agreement)")
    return "\n\n".join(tables + ["\n".join(notes + foot)])


if __name__ == "__main__":
    raise SystemExit(main(None))
