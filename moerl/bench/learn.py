"""`moerl bench learn`: does RL raise held-out accuracy, and how much sooner does async mode get there than sync?

    moerl bench learn                       # GPU: the 1.65B MoE (bf16) from a random init; CPU: the demo's model
    moerl bench learn --rl-seconds 200 --levels 0.1,0.2,0.3 --out runs/learn

1. Warm start, once, shared by both modes: supervised steps on the task's reference answers in chunks of
   --warm-chunk, until greedy accuracy on the held-out prompts first reaches --warm-target (so the task is still
   hard and RL has to raise it). The float32 weights become the checkpoint (model.path) both runs start from.
2. RL: one `moerl train` per mode on a local Ray, same config and seed, ending after --rl-seconds of RL
   (train.time_limit_s), evaluated greedily on the task's held-out split every --eval-every steps and before the
   first step (evals hold the rollout worker in both modes alike).
3. The table: accuracy before RL and at the end; the RL wall time to reach the warm start's accuracy + each level
   (the first eval at or over it, timed at the end of the step whose weights it evaluated), async against sync;
   samples/s; behaviour KL. learn.png plots accuracy against RL wall time for both modes.

The demo task (single-digit sums) has 100 problems: its held-out stream is seeded apart from the training
stream but draws from the same problems.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from moerl.bench.common import Row, format_table
from moerl.runlog.run_log import read_jsonl

GPU_SHAPE = ["--run.device=cuda", "--model.dtype=bfloat16", "--model.preset=medium", "--rollout.num_workers=1",
             "--rollout.gpus_per_worker=0.45", "--train.gpus_per_rank=0.45", "--ray.num_cpus=8",
             "--train.batch_groups=16", "--rollout.group_size=8", "--train.max_staleness=2",
             "--rollout.max_inflight_groups=32", "--train.sft_lr=1e-4", "--train.sft_batch=64",
             "--train.optim.lr=3e-5", "--eval.samples=256", "--rollout.heartbeat_s=5"]
CPU_SHAPE = ["--ray.num_cpus=2", "--eval.samples=200"]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moerl bench learn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo.toml")
    p.add_argument("--shape", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument("--rl-seconds", type=float, default=None, help="RL wall time per mode (GPU 200, CPU 90)")
    p.add_argument("--levels", default="0.1,0.2,0.3", help="accuracy gains over the warm start to time")
    p.add_argument("--warm-target", type=float, default=0.1, help="warm start until held-out accuracy >= this")
    p.add_argument("--warm-chunk", type=int, default=None, help="supervised steps between two evals (GPU 3, CPU 5)")
    p.add_argument("--warm-max-steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=None, help="RL steps between evals (GPU 30, CPU 25)")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--out", default="", help="keep the warm start, the runs and learn.png here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the warm start and every run, e.g. --set train.optim.lr=1e-5")
    return p.parse_args(argv)


def _shape(args: argparse.Namespace, gpu: bool) -> list[str]:
    return (GPU_SHAPE if gpu else CPU_SHAPE) + [f"--{kv.removeprefix('--')}" for kv in args.set]


def held_out_accuracy(engine, eval_set, prompts: int, sampling) -> float:
    """Greedy accuracy on the first `prompts` of the held-out split (what the run's eval scores)."""
    import dataclasses

    batch = [eval_set.prompt(i) for i in range(prompts)]
    done = engine.generate([p.prompt_token_ids for p in batch], dataclasses.replace(sampling, temperature=0.0))
    return sum(eval_set.task.reward(p, list(c.token_ids)) for p, c in zip(batch, done)) / len(batch)


def warm_start(args: argparse.Namespace, gpu: bool, out: Path) -> dict:
    """Supervised chunks until held-out accuracy reaches the target; the weights saved under `out`."""
    import torch

    from moerl.config import load_config
    from moerl.loop.evaluation import open_eval_set
    from moerl.model import build_model, save_pretrained
    from moerl.rollout import Engine
    from moerl.run import _specs, model_architecture, sft_samples
    from moerl.tasks.base import load_task
    from moerl.train.config import LossConfig, OptimConfig
    from moerl.train.trainer import PolicyTrainer

    cfg = load_config(args.config, _shape(args, gpu) + [f"--run.dir={out / 'unused'}"])
    task = load_task(cfg.task.name, dict(cfg.task.options), seed=cfg.run.seed)
    arch = model_architecture(cfg, task)
    spec, _ = _specs(cfg, arch, task)
    device, dtype = torch.device(spec.device), getattr(torch, cfg.model.dtype)
    trainer = PolicyTrainer(build_model(arch, dtype=torch.float32, device=device, seed=cfg.run.seed),
                            OptimConfig(lr=cfg.train.sft_lr), LossConfig(), compute_dtype=dtype,
                            micro_batch_tokens=cfg.train.micro_batch_tokens)
    engine = Engine(build_model(arch, dtype=dtype, device=device, init=False), spec.engine)
    eval_set = open_eval_set(task, cfg.task.name, dict(cfg.task.options), cfg.eval.path, cfg.run.seed)
    n = min(cfg.eval.samples, eval_set.size or cfg.eval.samples)
    history, step, t0 = [], 0, time.perf_counter()
    while True:
        engine.update_weights(trainer.model.state_dict(), version=step)
        acc = held_out_accuracy(engine, eval_set, n, spec.sampling)
        history.append((step, acc))
        print(f"warm start: step {step}, held-out accuracy {acc:.3f}", flush=True)
        if acc >= args.warm_target or step >= args.warm_max_steps:
            break
        for _ in range(args.warm_chunk):
            trainer.sft_step(sft_samples(task, step, cfg.train.sft_batch))
            step += 1
    path = out / "warm-start"
    save_pretrained(trainer.model, path)
    seconds = time.perf_counter() - t0
    del trainer, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the runs' Ray actors share this GPU
    return {"path": path, "steps": step, "accuracy": acc, "seconds": seconds, "history": history}


def run_mode(args: argparse.Namespace, gpu: bool, mode: str, warm: Path, run_dir: Path) -> dict:
    from moerl.config import load_config
    from moerl.run import train

    overrides = _shape(args, gpu) + [
        f"--model.path={warm}", "--train.sft_steps=0", f"--train.mode={mode}", "--train.steps=1000000",
        f"--train.time_limit_s={args.rl_seconds}", f"--eval.every={args.eval_every}", "--eval.before_train=true",
        f"--run.dir={run_dir}", f"--run.name=learn-{mode}"]
    train(load_config(args.config, overrides))
    return read_run(run_dir)


def read_run(run_dir: Path) -> dict:
    """The accuracy curve against RL wall time, and the run's rates, from its metrics.jsonl."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0 and "time/step_s" in r]
    evals = [r for r in rows if "eval/reward" in r]
    # RL starts when the first step starts; an eval at step s scores the weights that existed when s ended
    t0 = steps[0]["time"] - steps[0]["time/step_s"] if steps else 0.0
    ended = {r["step"]: r["time"] - t0 for r in steps}
    curve = [(0.0 if e["step"] == 0 else ended.get(e["step"], math.nan), e["eval/reward"]) for e in evals]
    curve = sorted((t, acc) for t, acc in curve if not math.isnan(t))
    wall = steps[-1]["time"] - t0 if steps else 0.0
    samples = sum(r.get("samples", 0) for r in steps)
    kl = sorted(r.get("is/behaviour_kl", 0.0) for r in steps) or [0.0]
    mean = lambda rows, key: sum(r.get(key, 0.0) for r in rows) / max(len(rows), 1)  # noqa: E731
    # Entropy and the share of groups whose rewards are all equal (no gradient) tell a collapsed policy apart
    return {"curve": curve, "steps": len(steps), "wall_s": wall, "samples_per_s": samples / max(wall, 1e-9),
            "kl_median": kl[len(kl) // 2], "kl_max": kl[-1],
            "entropy_first": mean(steps[:10], "policy/entropy"), "entropy_last": mean(steps[-10:], "policy/entropy"),
            "all_equal_last": mean(steps[-10:], "reward/all_equal_frac")}


def time_to(curve: list[tuple[float, float]], accuracy: float) -> float | None:
    """RL wall time of the first eval at or over `accuracy` (None: never within the run)."""
    return next((t for t, acc in curve if acc >= accuracy - 1e-9), None)


def plot(runs: dict[str, dict], warm_accuracy: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, r in runs.items():
        ts, accs = zip(*r["curve"]) if r["curve"] else ((), ())
        ax.plot(ts, accs, marker="o", ms=3, label=f"{mode} ({r['samples_per_s']:.0f} samples/s)")
    ax.axhline(warm_accuracy, color="grey", ls=":", lw=1, label="warm start")
    ax.set_xlabel("RL wall time (s)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("moerl bench learn: accuracy against wall time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    import torch

    gpu = args.shape == "gpu" or (args.shape == "auto" and torch.cuda.is_available())
    args.rl_seconds = args.rl_seconds or (200.0 if gpu else 90.0)
    args.eval_every = args.eval_every or (30 if gpu else 25)
    args.warm_chunk = args.warm_chunk or (3 if gpu else 5)
    levels = [float(x) for x in args.levels.split(",")]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="moerl-bench-learn-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"bench learn: {'GPU 1.65B bf16' if gpu else 'CPU demo'} shape, {args.config}; {args.rl_seconds:.0f} s of "
          f"RL per mode; outputs in {out}", flush=True)
    warm = warm_start(args, gpu, out)
    print(f"warm start: {warm['steps']} supervised steps in {warm['seconds']:.0f} s, held-out accuracy "
          f"{warm['accuracy']:.3f}", flush=True)
    runs = {}
    for mode in args.modes.split(","):
        runs[mode] = run_mode(args, gpu, mode, warm["path"], out / mode)
        r = runs[mode]
        print(f"{mode}: {r['steps']} steps in {r['wall_s']:.0f} s, {r['samples_per_s']:.1f} samples/s, accuracy "
              + " ".join(f"{acc:.2f}@{t:.0f}s" for t, acc in r["curve"]), flush=True)
    (out / "learn.json").write_text(json.dumps({"warm": {k: v for k, v in warm.items() if k != "path"},
                                                "runs": runs, "levels": levels}, indent=1))
    plot(runs, warm["accuracy"], out / "learn.png")
    print(table(runs, warm["accuracy"], levels))
    print(f"plot: {out / 'learn.png'}")
    return 0


def table(runs: dict[str, dict], warm_accuracy: float, levels: list[float]) -> str:
    from moerl.bench.loop import kl_verdict

    a, s = runs.get("async"), runs.get("sync")
    if a is None or s is None:
        return "\n".join(f"{m}: {r['curve']}" for m, r in runs.items())
    start = lambda r: r["curve"][0][1] if r["curve"] else math.nan  # noqa: E731 - the step-0 eval
    end = lambda r: r["curve"][-1][1] if r["curve"] else math.nan  # noqa: E731
    rows = [Row("held-out accuracy before RL (step-0 eval)", start(a), start(s), ""),
            Row("held-out accuracy at the end", end(a), end(s), ""),
            Row("accuracy gain over the warm start, at the end", end(a) - start(a), end(s) - start(s), "")]
    notes = []
    for level in levels:
        ta, ts = time_to(a["curve"], start(a) + level), time_to(s["curve"], start(s) + level)
        rows.append(Row(f"RL time to warm start + {level:g}", ta if ta is not None else math.inf,
                        ts if ts is not None else math.inf, "s", higher_is_better=False))
        if ta is None or ts is None:
            notes.append(f"not reached within the run: +{level:g}: " + ", ".join(
                f"{m} not reached" for m, t in (("async", ta), ("sync", ts)) if t is None))
    rows += [Row("throughput", a["samples_per_s"], s["samples_per_s"], "samples/s"),
             Row("behaviour KL per token, median step", a["kl_median"], s["kl_median"], "nats", higher_is_better=False),
             Row("behaviour KL per token, worst step", a["kl_max"], s["kl_max"], "nats", higher_is_better=False),
             Row("policy entropy, first 10 steps", a["entropy_first"], s["entropy_first"], "nats"),
             Row("policy entropy, last 10 steps", a["entropy_last"], s["entropy_last"], "nats"),
             Row("groups with all rewards equal, last 10 steps", a["all_equal_last"], s["all_equal_last"], "",
                 higher_is_better=False)]
    for mode, r in (("async", a), ("sync", s)):
        if r["all_equal_last"] >= 0.99 and r["entropy_last"] < 0.05:
            notes.append(f"{mode} collapsed: entropy {r['entropy_last']:.3g} and every group's rewards equal (no "
                         "gradient); lower train.optim.lr (or train.max_staleness)")
    text = format_table(f"\nlearning (peer column: sync mode; warm start {warm_accuracy:.3f} in-process)", rows,
                        peer_name="sync")
    return "\n".join([text, *notes,
                      kl_verdict({"async": a["kl_max"], "sync": s["kl_max"]})])
