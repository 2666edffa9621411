"""`moerl bench loop`: the whole RL loop, async and sync, against its own rollout engine running alone.

    moerl bench loop                        # the shape for the device found: GPU (1.65B MoE, bf16) or the CPU demo
    moerl bench loop --shape cpu --steps 150 --repeats 3

Each mode is a full `moerl train` on a local Ray. Throughput = samples trained / wall time of the RL phase.
The loop's ceiling is its rollout: the same engine configuration generating the same groups with nothing else
running ("engine alone", in this process on the same device), so loop efficiency = async samples/s / engine-alone
samples/s. The per-phase lines split the async run's step time (moerl/loop/phases.py), averaged over its steps.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from moerl.bench.common import Row, format_table

GPU_SHAPE = ["--run.device=cuda", "--model.dtype=bfloat16", "--model.preset=medium", "--train.sft_steps=0",
             "--train.optim.lr=1e-6", "--rollout.max_new_tokens=256", "--rollout.max_seq_len=320",
             "--rollout.max_batch_size=256", "--rollout.max_inflight_groups=0", "--train.max_staleness=4",
             "--rollout.num_workers=1",
             "--train.batch_groups=16", "--rollout.group_size=8", "--rollout.gpus_per_worker=0.45",
             "--train.gpus_per_rank=0.45", "--train.micro_batch_tokens=16384", "--ray.num_cpus=8"]
CPU_SHAPE = ["--rollout.num_workers=1", "--rollout.cpus_per_worker=1", "--train.cpus_per_rank=1", "--ray.num_cpus=2"]
PHASE_KEYS = ("idle", "train_wait", "publish", "transfer", "controller", "checkpoint")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moerl bench loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo.toml")
    p.add_argument("--shape", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (GPU 30, CPU 200)")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating; medians reported")
    p.add_argument("--out", default="", help="keep the run directories here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, e.g. --set weights.transport=object_store")
    return p.parse_args(argv)


def _overrides(args: argparse.Namespace, gpu: bool, mode: str, run_dir: Path) -> list[str]:
    steps = args.steps or (30 if gpu else 200)
    return (GPU_SHAPE if gpu else CPU_SHAPE) + [f"--train.mode={mode}", f"--train.steps={steps}",
                                                f"--run.dir={run_dir}"] + [f"--{kv.removeprefix('--')}" for kv in args.set]


def run_loop(args: argparse.Namespace, gpu: bool, mode: str, run_dir: Path) -> dict:
    from moerl.config import load_config
    from moerl.run import train

    train(load_config(args.config, _overrides(args, gpu, mode, run_dir)))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [r for r in rows if r["step"] > 0][1:]  # the first step carries the start-up
    samples = sum(r.get("samples", 0) for r in rl)
    tokens = sum(r.get("samples", 0) * r.get("length/mean", 0) for r in rl)
    wall = sum(r.get("time/step_s", 0.0) for r in rl)
    phases = {p: sum(r.get(f"time/{p}_s", 0.0) for r in rl) / max(wall, 1e-9) for p in PHASE_KEYS}
    inner = {k: sum(r.get(f"time/{k}_s", 0.0) for r in rl) / max(len(rl), 1)
             for k in ("fwd_bwd", "optimizer", "generate", "apply", "publish", "transfer", "step")}
    tail = rl[-max(1, len(rl) // 5):]
    kl = sorted(r.get("is/behaviour_kl", 0.0) for r in rl) or [0.0]
    return {"kl_max": kl[-1], "kl_median": kl[len(kl) // 2], "samples_per_s": samples / max(wall, 1e-9), "tokens_per_s": tokens / max(wall, 1e-9),
            "reward": sum(r.get("reward/mean", 0.0) for r in tail) / len(tail), "phases": phases, "inner": inner,
            "stale_dropped": rows[-1].get("count/stale_dropped", 0), "groups": rows[-1].get("count/groups_done", 0)}


def kl_verdict(worst: dict[str, float], bound: float | None = None) -> str:
    """One line: is every mode's worst step under the run's behaviour-KL bound (train.behaviour_kl_bound)?"""
    from moerl.config import TrainConfig

    bound = TrainConfig.behaviour_kl_bound if bound is None else bound
    over = {mode: kl for mode, kl in worst.items() if kl > bound}
    if not over:
        return f"behaviour KL: every step of every mode under the bound {bound:g}"
    return ("behaviour KL OVER the bound " + f"{bound:g}: " + ", ".join(f"{m} worst step {kl:.3g}" for m, kl in over.items())
            + ": the samples were drawn by another policy than the trainer's (see moerl/runlog/mismatch.py)")


def engine_alone(args: argparse.Namespace, gpu: bool, batches: int = 3) -> dict:
    """The rollout's ceiling: the run's engine and sampling on the run's prompts, nothing else running."""
    import dataclasses

    import torch

    from moerl.config import load_config
    from moerl.model import build_model
    from moerl.rollout import Engine
    from moerl.run import _specs, model_architecture
    from moerl.tasks.base import load_task

    cfg = load_config(args.config, _overrides(args, gpu, "async", Path(tempfile.mkdtemp())))
    task = load_task(cfg.task.name, dict(cfg.task.options), seed=cfg.run.seed)
    arch = model_architecture(cfg, task)
    spec, _ = _specs(cfg, arch, task)
    model = build_model(arch, dtype=getattr(torch, spec.dtype), device=spec.device, seed=0)
    engine = Engine(model, spec.engine)
    n, G = cfg.rollout.inflight_groups(), cfg.rollout.group_size

    def batch(seed: int) -> list:
        # New prompts per batch, as the loop leases them: the same ones again would hit the engine's prefix cache.
        prompts = [task.prompt_at(seed * n + i).prompt_token_ids for i in range(n)]
        params = [dataclasses.replace(spec.sampling, seed=seed * 100_000 + i) for i in range(n * G)]
        return engine.generate([p for p in prompts for _ in range(G)], params)
    batch(0)  # warm-up: CUDA graphs, kernels
    t0, samples, tokens = time.perf_counter(), 0, 0
    for b in range(1, batches + 1):
        done = batch(b)
        samples += len(done)
        tokens += sum(len(c.token_ids) for c in done)
    seconds = time.perf_counter() - t0
    return {"samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    import torch

    gpu = args.shape == "gpu" or (args.shape == "auto" and torch.cuda.is_available())
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="moerl-bench-loop-"))
    print(f"bench loop: {'GPU 1.65B bf16' if gpu else 'CPU demo'} shape, {args.config}; runs in {base}", flush=True)
    alone = engine_alone(args, gpu)
    print(f"engine alone: {alone['samples_per_s']:.1f} samples/s, {alone['tokens_per_s']:.0f} tok/s", flush=True)
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for i in range(max(1, args.repeats)):
        for mode in ("sync", "async"):
            runs[mode].append(run_loop(args, gpu, mode, base / f"{mode}-{i}"))
            r = runs[mode][-1]
            print(f"{mode:5}: {r['samples_per_s']:.1f} samples/s, reward {r['reward']:.3f}, "
                  f"{r['stale_dropped']:.0f} of {r['groups']:.0f} finished groups dropped as stale", flush=True)
    sync, asyn = (sorted(runs[m], key=lambda r: r["samples_per_s"])[len(runs[m]) // 2] for m in ("sync", "async"))
    rows = [Row("throughput (async vs sync)", asyn["samples_per_s"], sync["samples_per_s"], "samples/s"),
            Row("tokens generated and trained", asyn["tokens_per_s"], sync["tokens_per_s"], "tok/s"),
            Row("loop efficiency (async / engine alone)", asyn["samples_per_s"], alone["samples_per_s"],
                "samples/s", ceiling=alone["samples_per_s"]),
            Row("reward, last 20% of steps", asyn["reward"], sync["reward"], ""),
            Row("behaviour KL per token, median step", asyn["kl_median"], sync["kl_median"], "nats",
                higher_is_better=False),
            Row("behaviour KL per token, worst step", asyn["kl_max"], sync["kl_max"], "nats", higher_is_better=False)]
    print(format_table("\nthe RL loop (peer column: sync mode; efficiency row: the engine alone)", rows,
                       peer_name="sync / alone"))
    print(kl_verdict({"async": asyn["kl_max"], "sync": sync["kl_max"]}))
    for name, r in (("async", asyn), ("sync", sync)):
        shares = " ".join(f"{p} {100 * f:.0f}%" for p, f in r["phases"].items())
        inner = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in r["inner"].items())
        print(f"{name} step time: {shares}; per step: {inner}")
    # Sync mode waits for each version from the publish call until every worker applied it.
    print(f"weight sync (sync mode, per version): publish to applied "
          f"{1e3 * (sync['inner']['publish'] + sync['inner']['transfer']):.0f} ms, decode paused "
          f"{1e3 * sync['inner']['apply']:.0f} ms")
    return 0
