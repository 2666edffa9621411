"""`moerl bench async`: the demo's RL budget in sync and in async mode, and async with workers being killed.

    moerl bench async                       # configs/demo.toml, 1 rollout worker + 1 trainer rank, 1 CPU each
    moerl bench async --steps 150 --kill-every 30
    moerl bench async --repeats 3           # sync/async alternated 3 times, medians reported

Each run is a full `moerl train` (local Ray). Throughput = samples trained / wall time of the RL phase (from the
first trainer step's start, so Ray start-up and the warm start are excluded). Reward = mean over the last 20% of
steps. The kill run SIGKILLs a random rollout worker every --kill-every seconds; it must lose and duplicate no task.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from moerl.bench import options
from moerl.bench.common import Row, format_table


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("async").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def _run(args: argparse.Namespace, mode: str, run_dir: Path, kill_every: float = 0.0) -> dict:
    from moerl.config import load_config
    from moerl.run import train

    overrides = [f"--train.mode={mode}", f"--train.steps={args.steps}", f"--run.dir={run_dir}",
                 f"--rollout.num_workers={args.workers}", "--rollout.cpus_per_worker=1", "--train.cpus_per_rank=1",
                 f"--ray.num_cpus={args.workers + 1}"] + ([f"--model.preset={args.preset}"] if args.preset else [])
    cfg = load_config(args.config, overrides)
    stop = threading.Event()
    kills: list[float] = []
    if kill_every > 0:
        threading.Thread(target=_killer, args=(kill_every, stop, kills, args.workers), daemon=True).start()
    try:
        result = train(cfg)
    finally:
        stop.set()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    traj = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines() if line.strip()]
    return {**run_rates(rows, traj), "kills": len(kills), "failed_tasks": len(result["failed_tasks"]),
            "counters": result["counters"], "queue": result["queue"]}


def run_rates(rows: list[dict], trajectories: list[dict]) -> dict:
    """A run's throughput, reward and duplicates from its metrics and trajectory rows. The window starts when the
    first RL step's training began (its time less its time/train_s: the rollout before it is start-up) and ends
    at the last step; the reward is the mean of the last 20% of the steps; a duplicate is a (task, sample) trained
    twice."""
    rl = [r for r in rows if r["step"] > 0]
    t0 = rl[0]["time"] - rl[0].get("time/train_s", 0.0)
    samples = sum(r.get("samples", 0) for r in rl)
    tail = rl[-max(1, len(rl) // 5):]
    keys = [(t["task_id"], t["sample_index"]) for t in trajectories]
    return {"samples_per_s": samples / max(1e-9, rl[-1]["time"] - t0),
            "reward": sum(r.get("reward/mean", 0.0) for r in tail) / len(tail),
            "duplicates": len(keys) - len(set(keys))}


def _killer(every: float, stop: threading.Event, kills: list[float], workers: int) -> None:
    import ray

    rng = random.Random(0)
    while not stop.wait(every):
        try:
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if str(a.get("name", "")).startswith("RolloutWorker-")]
            if not names:
                continue
            pid = ray.get(ray.get_actor(rng.choice(names)).ping.remote(), timeout=10)["pid"]
            os.kill(pid, signal.SIGKILL)
            kills.append(time.monotonic())
        except Exception:  # noqa: BLE001 - a worker may be restarting; try again next period
            continue


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="moerl-bench-async-"))
    print(f"bench async: {args.config}, {args.steps} steps, {args.workers} rollout worker(s) + 1 trainer rank, "
          f"1 CPU each; runs in {base}")
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for i in range(max(1, args.repeats)):
        for mode in ("sync", "async"):
            r = _run(args, mode, base / f"{mode}-{i}")
            runs[mode].append(r)
            print(f"{mode:5}: {r['samples_per_s']:.1f} samples/s, final reward {r['reward']:.3f}")
    sync, asyn = (_median(runs[m]) for m in ("sync", "async"))
    reward = {m: sum(r["reward"] for r in rs) / len(rs) for m, rs in runs.items()}  # mean over the repeats
    if args.repeats > 1:
        print("medians of " + ", ".join(f"{m} {[round(r['samples_per_s']) for r in runs[m]]}" for m in runs))
    rows = [Row("throughput", asyn["samples_per_s"], sync["samples_per_s"], "samples/s"),
            Row("final reward (last 20% of steps, mean of runs)", reward["async"], reward["sync"], "")]
    killed = None
    if args.kill_every > 0:
        killed = _run(args, "async", base / "async-kill", args.kill_every)
        print(f"async, a worker SIGKILLed every {args.kill_every:.0f}s: {killed['samples_per_s']:.1f} samples/s, "
              f"{killed['kills']} kills, counters {killed['counters']}")
        rows.append(Row("async with kills vs clean async", killed["samples_per_s"], asyn["samples_per_s"],
                        "samples/s"))
    print(format_table("\nasync vs sync RL (peer column: sync mode; last row: clean async)", rows, peer_name="sync"))
    every = runs["sync"] + runs["async"] + ([killed] if killed else [])
    for name, r in (("sync", sync), ("async", asyn), ("async+kills", killed)):
        if r is not None:
            print(f"{name}: duplicated samples {r['duplicates']}, failed tasks {r['failed_tasks']}, "
                  f"queue {r['queue']}")
    return 0 if all(r["duplicates"] == 0 for r in every) else 1


def _median(results: list[dict]) -> dict:
    """The run with the median throughput (its reward and counters come with it)."""
    return sorted(results, key=lambda r: r["samples_per_s"])[len(results) // 2]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
