"""`moerl bench learn`: does RL raise accuracy on problems it never trained on, over several seeds, and how much
sooner does asynchronous RL get there than synchronous?

    moerl bench learn                                   # GPU: the 1.65B MoE (bf16); CPU: the demo model
    moerl bench learn --shape cpu --arms sync,async --seeds 0,1,2 --rl-seconds 60
    moerl bench learn --shape cpu --arms stale4/legacy,stale4 --rl-steps 300 --set train.optim.lr=1e-3
    moerl bench learn --report runs/learn               # the table and plot of runs already made

The task: two-digit sums (0..99 + 0..99), a fifth of the problems held out by a hash of their text
(moerl/tasks/arithmetic.py): the random-init model must learn to add, with carries, to score on them.

Arms, `schedule[/objective]`:
  schedules   sync; async (train.max_staleness of the shape: GPU 2, CPU 1); asyncK (max_staleness K);
              staleK (train.forced_staleness K: every batch exactly K versions behind, in lock-step, whatever the
              timing: staleness robustness measured without depending on the machine's pace)
  objectives  default (the shipped loss); legacy (4dcea02's: no clip, TIS against the current policy);
              behaviour (clip against the rollout's log-probs); proximal (AReaL's decoupled PPO, 4 updates per step);
              m2po (behaviour + M2PO's mask); ess (behaviour + VCPO's ESS-scaled step)
  and after `@`, overrides of that arm alone: `stale4/proximal@train.optim.lr=7.5e-5;train.minibatches=2`

1. Per seed, one warm start shared by that seed's arms: supervised steps on the training problems, in chunks of
   --warm-chunk, until greedy accuracy on the held-out problems first reaches --warm-target. Deterministic in the
   seed (a GPU call regenerates it), its accuracy printed.
2. Per seed and arm, one `moerl train` from it on a local Ray, ending after --rl-seconds of RL or --rl-steps steps,
   evaluated greedily on every held-out problem every --eval-every steps and before the first step.
3. The table (moerl/bench/learn_report.py): per arm, median [min, max] over seeds of the held-out accuracy before and
   after, train reward, time to sync's final accuracy and to fixed gains, throughput and health; learn.png the
   curves with their spread. A run or warm start already in --out is read, not made again (--rerun to redo).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
import time
from pathlib import Path

from moerl.bench.learn_report import plot, read_run, summarize, table

TASK = ['--task.options={max_operand = 99, ops = "+", held_out = 0.2}', "--eval.samples=0"]
GPU_SHAPE = ["--run.device=cuda", "--model.dtype=bfloat16", "--model.preset=medium", "--rollout.num_workers=1",
             "--rollout.gpus_per_worker=0.45", "--train.gpus_per_rank=0.45", "--ray.num_cpus=8",
             "--train.batch_groups=16", "--rollout.group_size=8", "--train.max_staleness=2",
             "--rollout.max_inflight_groups=32", "--train.sft_lr=1e-4", "--train.sft_batch=64",
             "--train.optim.lr=3e-5", "--rollout.heartbeat_s=5"]
CPU_SHAPE = ["--ray.num_cpus=2", "--train.optim.lr=1e-4"]
OBJECTIVES = {
    "default": [],
    "legacy": ["--train.loss.trust_region=none", "--train.loss.is_correction=tis"],
    "behaviour": ["--train.loss.trust_region=behaviour", "--train.loss.is_correction=none"],
    "proximal": ["--train.loss.trust_region=proximal", "--train.minibatches=4", "--train.loss.is_correction=tis"],
    "m2po": ["--train.loss.trust_region=behaviour", "--train.loss.is_correction=m2po"],
    "ess": ["--train.loss.trust_region=behaviour", "--train.loss.is_correction=none", "--train.loss.ess_lr_scaling=true"],
}


def arm_overrides(arm: str) -> list[str]:
    """The overrides of `schedule[/objective][@key=value;...]` (module doc); ValueError naming the arm when it is
    not one."""
    arm, _, extra = arm.partition("@")
    extra_overrides = [f"--{kv.strip()}" for kv in extra.split(";") if kv.strip()]
    if any("=" not in kv for kv in extra_overrides):
        raise ValueError(f"--arms: {arm}@{extra} has an override without '=' (key=value;key=value)")
    schedule, _, objective = arm.partition("/")
    if (objective or "default") not in OBJECTIVES:
        raise ValueError(f"--arms: {arm!r} has objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    if schedule == "sync":
        sched = ["--train.mode=sync"]
    elif schedule == "async":
        sched = ["--train.mode=async"]
    elif m := re.fullmatch(r"async(\d+)", schedule):
        sched = ["--train.mode=async", f"--train.max_staleness={m[1]}"]
    elif m := re.fullmatch(r"stale(\d+)", schedule):
        sched = ["--train.mode=async", f"--train.max_staleness={m[1]}", f"--train.forced_staleness={m[1]}"]
    else:
        raise ValueError(f"--arms: {arm!r} has schedule {schedule!r}; known: sync, async, asyncK, staleK (K >= 1)")
    return sched + OBJECTIVES[objective or "default"] + extra_overrides


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moerl bench learn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo.toml")
    p.add_argument("--shape", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument("--arms", default="sync,async", help="comma-separated schedule[/objective] (see above)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds")
    p.add_argument("--rl-seconds", type=float, default=None, help="RL wall time per run (GPU 360, CPU 60)")
    p.add_argument("--rl-steps", type=int, default=1_000_000, help="RL steps per run at most")
    p.add_argument("--levels", default="0.1,0.2", help="accuracy gains over the warm start to time")
    p.add_argument("--warm-target", type=float, default=0.3, help="warm start until held-out accuracy >= this")
    p.add_argument("--warm-chunk", type=int, default=None, help="supervised steps between two evals (GPU 10, CPU 50)")
    p.add_argument("--warm-max-steps", type=int, default=3000)
    p.add_argument("--eval-every", type=int, default=None, help="RL steps between evals (GPU 20, CPU 50)")
    p.add_argument("--out", default="", help="the warm starts, the runs, learn.json and learn.png go here")
    p.add_argument("--rerun", action="store_true", help="run again the runs already in --out")
    p.add_argument("--report", default="", metavar="DIR", help="no runs: the table and plot of the runs under DIR")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for the warm starts and every run, e.g. --set train.optim.lr=1e-5")
    args = p.parse_args(argv)
    try:
        args.arm_list = [a.strip() for a in args.arms.split(",") if a.strip()]
        for arm in args.arm_list:
            arm_overrides(arm)
        args.seed_list = [int(s) for s in args.seeds.split(",")]
        args.level_list = [float(x) for x in args.levels.split(",")]
    except ValueError as e:
        p.error(str(e))
    return args


def _shape(args: argparse.Namespace, gpu: bool) -> list[str]:
    return TASK + (GPU_SHAPE if gpu else CPU_SHAPE) + [f"--{kv.removeprefix('--')}" for kv in args.set]


def _arm_dir(arm: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", arm)


def held_out_accuracy(engine, eval_set, prompts: int, sampling) -> float:
    """Greedy accuracy on the first `prompts` of the held-out split (what the run's eval scores)."""
    batch = [eval_set.prompt(i) for i in range(prompts)]
    done = engine.generate([p.prompt_token_ids for p in batch], dataclasses.replace(sampling, temperature=0.0))
    return sum(eval_set.task.reward(p, list(c.token_ids)) for p, c in zip(batch, done)) / len(batch)


def warm_start(args: argparse.Namespace, gpu: bool, out: Path, seed: int = 0) -> dict:
    """Supervised chunks until held-out accuracy reaches the target; the weights saved under `out`."""
    import torch

    from moerl.config import load_config
    from moerl.loop.evaluation import eval_prompt_count, open_eval_set
    from moerl.model import build_model, save_pretrained
    from moerl.rollout import Engine
    from moerl.run import _specs, model_architecture, sft_samples
    from moerl.tasks.base import load_task
    from moerl.train.config import LossConfig, OptimConfig
    from moerl.train.trainer import PolicyTrainer

    cfg = load_config(args.config, _shape(args, gpu) + [f"--run.dir={out / 'unused'}", f"--run.seed={seed}"])
    torch.manual_seed(seed)
    task = load_task(cfg.task.name, dict(cfg.task.options), seed=cfg.run.seed)
    arch = model_architecture(cfg, task)
    spec, _ = _specs(cfg, arch, task)
    device, dtype = torch.device(spec.device), getattr(torch, cfg.model.dtype)
    trainer = PolicyTrainer(build_model(arch, dtype=torch.float32, device=device, seed=cfg.run.seed),
                            OptimConfig(lr=cfg.train.sft_lr), LossConfig(), compute_dtype=dtype,
                            micro_batch_tokens=cfg.train.micro_batch_tokens)
    engine = Engine(build_model(arch, dtype=dtype, device=device, init=False), spec.engine)
    eval_set = open_eval_set(task, cfg.task.name, dict(cfg.task.options), cfg.eval.path, cfg.run.seed)
    n = eval_prompt_count(eval_set.size, cfg.eval.samples)
    history, step, t0 = [], 0, time.perf_counter()
    while True:
        engine.update_weights(trainer.model.state_dict(), version=step)
        acc = held_out_accuracy(engine, eval_set, n, spec.sampling)
        history.append((step, acc))
        print(f"warm start (seed {seed}): step {step}, held-out accuracy {acc:.3f}", flush=True)
        if acc >= args.warm_target or step >= args.warm_max_steps:
            break
        for _ in range(args.warm_chunk):
            trainer.sft_step(sft_samples(task, step, cfg.train.sft_batch))
            step += 1
    save_pretrained(trainer.model, out)
    seconds = time.perf_counter() - t0
    del trainer, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the runs' Ray actors share this GPU
    return {"path": str(out), "steps": step, "accuracy": acc, "seconds": seconds, "history": history}


def run_arm(args: argparse.Namespace, gpu: bool, arm: str, seed: int, warm: Path, run_dir: Path) -> dict:
    from moerl.config import load_config
    from moerl.run import train

    overrides = _shape(args, gpu) + arm_overrides(arm) + [
        f"--model.path={warm}", "--train.sft_steps=0", f"--train.steps={args.rl_steps}", f"--run.seed={seed}",
        f"--train.time_limit_s={args.rl_seconds}", f"--eval.every={args.eval_every}", "--eval.before_train=true",
        f"--run.dir={run_dir}", f"--run.name=learn-{_arm_dir(arm)}-{seed}"]
    train(load_config(args.config, overrides))
    run = read_run(run_dir)
    (run_dir / "run.json").write_text(json.dumps({"arm": arm, "seed": seed, "overrides": overrides, "run": run}))
    return run


def collect(out: Path) -> tuple[dict[str, list[dict]], dict[int, float]]:
    """Every finished run under `out` (seed*/ARM/run.json), by arm, and every seed's warm-start accuracy."""
    runs: dict[str, list[dict]] = {}
    for path in sorted(out.glob("seed*/*/run.json")):
        d = json.loads(path.read_text())
        runs.setdefault(d["arm"], []).append({**d["run"], "seed": d["seed"]})
    warm = {}
    for path in sorted(out.glob("seed*/warm.json")):
        d = json.loads(path.read_text())
        warm[d["seed"]] = d["accuracy"]
    return runs, warm


def report(out: Path, levels: list[float], title: str = "") -> str:
    runs, warm = collect(out)
    if not runs:
        raise SystemExit(f"bench learn: no finished runs under {out} (seed*/ARM/run.json)")
    stats = summarize(runs, levels)
    (out / "learn.json").write_text(json.dumps({"stats": stats, "warm": warm, "levels": levels}, indent=1))
    plot(runs, out / "learn.png", title)
    return table(stats, levels, warm)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    if args.report:
        print(report(Path(args.report), args.level_list))
        print(f"plot: {Path(args.report) / 'learn.png'}")
        return 0
    import torch

    gpu = args.shape == "gpu" or (args.shape == "auto" and torch.cuda.is_available())
    args.rl_seconds = args.rl_seconds if args.rl_seconds is not None else (360.0 if gpu else 60.0)
    args.eval_every = args.eval_every or (20 if gpu else 50)
    args.warm_chunk = args.warm_chunk or (10 if gpu else 50)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="moerl-bench-learn-"))
    out.mkdir(parents=True, exist_ok=True)
    total = len(args.seed_list) * len(args.arm_list)
    print(f"bench learn: {'GPU 1.65B bf16' if gpu else 'CPU demo'} shape, {args.config}; arms {', '.join(args.arm_list)}"
          f"; seeds {args.seeds}; {args.rl_seconds:.0f} s (or {args.rl_steps} steps) of RL per run, {total} runs; "
          f"outputs in {out}", flush=True)
    done = 0
    for seed in args.seed_list:
        seed_dir = out / f"seed{seed}"
        todo = [a for a in args.arm_list if args.rerun or not (seed_dir / _arm_dir(a) / "run.json").exists()]
        if not todo:
            done += len(args.arm_list)
            continue
        if not args.rerun and (seed_dir / "warm.json").exists() and (seed_dir / "warm-start").exists():
            warm = json.loads((seed_dir / "warm.json").read_text())  # deterministic in the seed: made already
        else:
            warm = warm_start(args, gpu, seed_dir / "warm-start", seed)
            (seed_dir / "warm.json").write_text(json.dumps({"seed": seed, **warm}))
        print(f"warm start (seed {seed}): {warm['steps']} supervised steps in {warm['seconds']:.0f} s, held-out "
              f"accuracy {warm['accuracy']:.3f}", flush=True)
        for arm in args.arm_list:
            done += 1
            if arm not in todo:
                continue
            run_dir = seed_dir / _arm_dir(arm)
            if run_dir.exists():
                import shutil

                shutil.rmtree(run_dir)  # `moerl train` never overwrites a run
            r = run_arm(args, gpu, arm, seed, Path(warm["path"]), run_dir)
            print(f"[{done}/{total}] {arm} seed {seed}: {r['steps']} steps in {r['wall_s']:.0f} s, "
                  f"{r['samples_per_s']:.1f} samples/s, held-out accuracy "
                  + " ".join(f"{acc:.2f}@{t:.0f}s" for t, _, acc in r["curve"]), flush=True)
    print(report(out, args.level_list))
    print(f"plot: {out / 'learn.png'}")
    return 0
