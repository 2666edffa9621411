"""`moerl bench loop`: the whole RL loop, async and sync, against its own rollout engine fed continuously alone.

    moerl bench loop                        # the shape for the device found: GPU (1.65B MoE, bf16) or the CPU demo
    moerl bench loop --shape cpu --steps 150 --repeats 3

Each mode is a full `moerl train` on a local Ray. Rates count the steps after the first 20% (start-up, CUDA
graph captures and the first publish stay out of every rate): samples trained / wall time of those steps.
Three runs: sync (a batch of `batch_groups` groups in flight, its best), async at its best (as many groups in
flight as its staleness bound and `rollout.max_inflight_groups` allow), and async at sync's concurrency (at most
`batch_groups` groups in flight), so async's gain is told apart from having more sequences in flight.
The ceiling is the rollout alone: the same engine configuration on the same kind of prompts in this process,
fed continuously (a new request the moment one finishes) at the async loop's concurrency for the async run's
measured wall window, so loop efficiency = async samples/s / that ceiling and cannot pass 1 by the engine alone
tailing off at the end of a batch. The per-phase lines split the async run's step time (moerl/loop/phases.py).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from moerl.bench import options
from moerl.bench.common import Row, format_table
from moerl.runlog.run_log import read_jsonl

GPU_SHAPE = ["--run.device=cuda", "--model.dtype=bfloat16", "--model.preset=medium", "--train.sft_steps=0",
             "--train.optim.lr=1e-6", "--rollout.max_new_tokens=256", "--rollout.max_seq_len=320",
             "--rollout.max_batch_size=256", "--rollout.max_inflight_groups=0", "--train.max_staleness=4",
             "--rollout.num_workers=1",
             "--train.batch_groups=16", "--rollout.group_size=8", "--rollout.gpus_per_worker=0.45",
             "--train.gpus_per_rank=0.45", "--train.micro_batch_tokens=16384", "--ray.num_cpus=8"]
CPU_SHAPE = ["--rollout.num_workers=1", "--rollout.cpus_per_worker=1", "--train.cpus_per_rank=1", "--ray.num_cpus=2"]
PHASE_KEYS = ("idle", "train_wait", "publish", "transfer", "controller", "checkpoint")


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("loop").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def _overrides(args: argparse.Namespace, gpu: bool, mode: str, run_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
    steps = args.steps or (30 if gpu else 200)
    return (GPU_SHAPE if gpu else CPU_SHAPE) + [f"--train.mode={mode}", f"--train.steps={steps}",
                                                f"--run.dir={run_dir}"] + [f"--{kv.removeprefix('--')}" for kv in args.set] + list(extra)


def run_loop(args: argparse.Namespace, gpu: bool, mode: str, run_dir: Path, extra: tuple[str, ...] = ()) -> dict:
    from moerl.config import load_config
    from moerl.run import train

    cfg = load_config(args.config, _overrides(args, gpu, mode, run_dir, extra))
    train(cfg)
    return {**loop_rates(read_jsonl(run_dir / "metrics.jsonl")), "inflight_groups": _concurrency(cfg)}


def loop_rates(rows: list[dict]) -> dict:
    """A run's numbers from its metrics.jsonl rows. Rates count the training steps after the first 20% (at least
    the first step: start-up, graph captures and the first publish stay out): samples (and samples x mean length)
    over the sum of those steps' time/step_s; phases as shares of that time; the inner times per step; the reward
    of the last 20% of those steps; the behaviour KL's worst and median step."""
    steps = [r for r in rows if r["step"] > 0 and "time/step_s" in r]
    rl = steps[max(1, len(steps) // 5):]  # start-up stays out of every rate
    samples = sum(r.get("samples", 0) for r in rl)
    tokens = sum(r.get("samples", 0) * r.get("length/mean", 0) for r in rl)
    wall = sum(r.get("time/step_s", 0.0) for r in rl)
    phases = {p: sum(r.get(f"time/{p}_s", 0.0) for r in rl) / max(wall, 1e-9) for p in PHASE_KEYS}
    inner = {k: sum(r.get(f"time/{k}_s", 0.0) for r in rl) / max(len(rl), 1)
             for k in ("fwd_bwd", "optimizer", "generate", "apply", "publish", "transfer", "step")}
    tail = rl[-max(1, len(rl) // 5):]
    kl = sorted(r.get("is/behaviour_kl", 0.0) for r in rl) or [0.0]
    counters = steps[-1] if steps else {}  # the last training row's: an eval's row may come after it
    return {"kl_max": kl[-1], "kl_median": kl[len(kl) // 2], "samples_per_s": samples / max(wall, 1e-9),
            "tokens_per_s": tokens / max(wall, 1e-9), "wall_s": wall,
            "reward": sum(r.get("reward/mean", 0.0) for r in tail) / len(tail), "phases": phases, "inner": inner,
            "stale_dropped": counters.get("count/stale_dropped", 0), "groups": counters.get("count/groups_done", 0)}


def kl_verdict(worst: dict[str, float], bound: float | None = None) -> str:
    """One line: is every mode's worst step under the run's behaviour-KL bound (train.behaviour_kl_bound)?"""
    from moerl.config import TrainConfig

    bound = TrainConfig.behaviour_kl_bound if bound is None else bound
    over = {mode: kl for mode, kl in worst.items() if kl > bound}
    if not over:
        return f"behaviour KL: every step of every mode under the bound {bound:g}"
    return ("behaviour KL OVER the bound " + f"{bound:g}: " + ", ".join(f"{m} worst step {kl:.3g}" for m, kl in over.items())
            + ": the samples were drawn by another policy than the trainer's (see moerl/runlog/mismatch.py)")


def _concurrency(cfg) -> int:
    """Groups the loop keeps in flight at most: sync leases one batch per version, async up to its staleness bound,
    each capped by what the workers take (rollout.max_inflight_groups per worker)."""
    t, workers = cfg.train, cfg.rollout.num_workers * cfg.rollout.inflight_groups()
    gate = t.batch_groups if t.mode == "sync" else (t.max_staleness + 1) * t.batch_groups
    return min(gate, workers)


def engine_alone(args: argparse.Namespace, gpu: bool, inflight_groups: int, seconds: float) -> dict:
    """The rollout's ceiling: the run's engine and sampling, nothing else running, fed continuously with
    `inflight_groups` groups in flight (a new request as soon as one finishes) for `seconds` after a warm-up."""
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
    torch.set_num_threads(cfg.rollout.threads)  # as a rollout worker runs it (its own process, rollout.threads)
    G = cfg.rollout.group_size
    submitted = 0

    def submit() -> None:  # one request; a new prompt every G (new prompts, as the loop leases: no stale prefix hits)
        nonlocal submitted
        prompt = task.prompt_at(submitted // G).prompt_token_ids
        engine.submit(prompt, dataclasses.replace(spec.sampling, seed=submitted))
        submitted += 1

    for _ in range(inflight_groups * G):
        submit()

    fed_continuously(engine.step, submit, min(10.0, seconds / 4))  # warm-up: CUDA graphs, kernels, first prefills
    before = dict(engine.stats, steps=engine.steps)
    samples, tokens, wall = fed_continuously(engine.step, submit, seconds)
    return {"samples_per_s": samples / wall, "tokens_per_s": tokens / wall, "seconds": wall,
            "inflight_groups": inflight_groups, **occupancy(before, dict(engine.stats, steps=engine.steps),
                                                            spec.engine.max_batch_size, wall)}


def occupancy(before: dict, after: dict, slots: int, wall: float) -> dict:
    """The engine's batch over a timed window, from its counters at both ends: decode rows per decode step (of
    `slots`), wall ms per engine step (prefill and decode together) and the share of prompt tokens in the work."""
    delta = {k: after[k] - before[k] for k in ("decode_tokens", "decode_steps", "prefill_tokens", "steps")}
    return {"decode_rows": delta["decode_tokens"] / max(delta["decode_steps"], 1), "slots": slots,
            "step_ms": 1e3 * wall / max(delta["steps"], 1),
            "prefill_share": delta["prefill_tokens"] / max(delta["prefill_tokens"] + delta["decode_tokens"], 1)}


def fed_continuously(step, submit, window: float, clock=time.perf_counter) -> tuple[int, int, float]:
    """(completions, their tokens, seconds) of `step()` called until `window` seconds have passed on `clock`: each
    completion a step returns is counted and replaced at once (`submit()`), so the concurrency stays what it was."""
    t0, samples, tokens = clock(), 0, 0
    while clock() - t0 < window:
        for out in step():
            if out.completion is not None:
                samples += 1
                tokens += len(out.completion.token_ids)
                submit()
    return samples, tokens, clock() - t0


def _sync_groups(args: argparse.Namespace, gpu: bool, base: Path) -> int:
    """Groups sync mode keeps in flight (one batch) per worker: async capped to it runs at sync's concurrency."""
    from moerl.config import load_config

    cfg = load_config(args.config, _overrides(args, gpu, "sync", base / "unused"))
    return max(1, -(-_concurrency(cfg) // cfg.rollout.num_workers))


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    import torch

    gpu = args.shape == "gpu" or (args.shape == "auto" and torch.cuda.is_available())
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="moerl-bench-loop-"))
    print(f"bench loop: {'GPU 1.65B bf16' if gpu else 'CPU demo'} shape, {args.config}; runs in {base}", flush=True)
    sync_batch = f"--rollout.max_inflight_groups={_sync_groups(args, gpu, base)}"
    plans = {"sync": ("sync", ()), "async": ("async", ()), "async@sync": ("async", (sync_batch,))}
    runs: dict[str, list[dict]] = {name: [] for name in plans}
    for i in range(max(1, args.repeats)):
        for name, (mode, extra) in plans.items():
            runs[name].append(run_loop(args, gpu, mode, base / f"{name}-{i}", extra))
            r = runs[name][-1]
            print(f"{name:10}: {r['samples_per_s']:.1f} samples/s with up to {r['inflight_groups']} groups in flight, "
                  f"reward {r['reward']:.3f}, {r['stale_dropped']:.0f} of {r['groups']:.0f} finished groups "
                  "dropped as stale", flush=True)
    sync, asyn, equal = (sorted(runs[m], key=lambda r: r["samples_per_s"])[len(runs[m]) // 2]
                         for m in ("sync", "async", "async@sync"))
    alone = engine_alone(args, gpu, asyn["inflight_groups"], max(5.0, asyn["wall_s"]))
    print(f"engine alone, fed continuously at {alone['inflight_groups']} groups for {alone['seconds']:.0f} s: "
          f"{alone['samples_per_s']:.1f} samples/s, {alone['tokens_per_s']:.0f} tok/s; {alone['decode_rows']:.0f} "
          f"decode rows per step of {alone['slots']} slots, {alone['step_ms']:.2f} ms per engine step, prompt "
          f"tokens {100 * alone['prefill_share']:.0f}% of the tokens computed", flush=True)
    rows = [Row("throughput, each mode at its best", asyn["samples_per_s"], sync["samples_per_s"], "samples/s"),
            Row("throughput, equal concurrency (async at sync's)", equal["samples_per_s"], sync["samples_per_s"],
                "samples/s"),
            Row("tokens generated and trained (best)", asyn["tokens_per_s"], sync["tokens_per_s"], "tok/s"),
            Row("loop efficiency (async / engine alone)", asyn["samples_per_s"], alone["samples_per_s"],
                "samples/s", ceiling=alone["samples_per_s"]),
            Row("reward, last 20% of steps", asyn["reward"], sync["reward"], ""),
            Row("behaviour KL per token, median step", asyn["kl_median"], sync["kl_median"], "nats",
                higher_is_better=False),
            Row("behaviour KL per token, worst step", asyn["kl_max"], sync["kl_max"], "nats", higher_is_better=False)]
    print(format_table("\nthe RL loop (peer column: sync mode; efficiency row: the engine alone)", rows,
                       peer_name="sync / alone"))
    print(kl_verdict({"async": asyn["kl_max"], "sync": sync["kl_max"], "async@sync": equal["kl_max"]}))
    for name, r in (("async", asyn), ("sync", sync)):
        shares = " ".join(f"{p} {100 * f:.0f}%" for p, f in r["phases"].items())
        inner = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in r["inner"].items())
        print(f"{name} step time: {shares}; per step: {inner}")
    # Sync mode waits for each version from the publish call until every worker applied it.
    print(f"weight sync (sync mode, per version): publish to applied "
          f"{1e3 * (sync['inner']['publish'] + sync['inner']['transfer']):.0f} ms, decode paused "
          f"{1e3 * sync['inner']['apply']:.0f} ms")
    return 0
