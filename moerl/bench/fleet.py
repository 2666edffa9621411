"""`moerl bench fleet`: the real controller (moerl/loop) driving a simulated fleet of rollout engines, a trainer
and weight sync on a simulated clock (moerl/bench/fleet_sim.py), at 256 or 1,024 engines on one core.

It reports the controller's CPU per group and its share of one core (process CPU time, not wall time), the time
from a group finishing on its engine to the controller taking it, lease-to-result and queue waits, resident memory
across the run, the staleness of the trained samples, trainer utilisation and idle time, and samples/s. The
reference column is `moerl bench plan`'s closed-form prediction for the same shape (moerl/bench/plan.py).

    moerl bench fleet --engines 256,1024 --groups 100000
    moerl bench fleet --engines 256 --groups 1000000 --max-new-tokens 256 --no-trajectories   # memory over 10^6
"""

from __future__ import annotations

import dataclasses
import datetime
import sys

from moerl.bench.fleet_model import EngineModel
from moerl.bench.fleet_sim import FleetReport, FleetSimConfig, simulate
from moerl.bench.options import parser
from moerl.bench.plan import Workload, predict

CORE_LIMIT = 0.25  # issue 38: the controller at 256 engines uses at most a quarter of one core


def config(args, engines: int) -> FleetSimConfig:
    return FleetSimConfig(
        engines=engines, groups=args.groups, batch_groups=args.batch_groups, group_size=args.group_size,
        max_staleness=args.max_staleness, inflight_per_engine=args.inflight_per_engine, prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens, lengths=args.lengths,
        engine=EngineModel(step_base_s=args.step_base_ms / 1e3, step_row_s=args.step_row_us / 1e6,
                           max_batch=args.max_batch, respawn_s=args.respawn_s),
        train_tok_s=args.train_tok_s, step_fixed_s=args.step_fixed_s, publish_s=args.publish_s, transfer_s=args.transfer_s,
        preempt_per_hour=args.preempt_per_hour, trajectories=not args.no_trajectories, seed=args.seed)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def table(r: FleetReport) -> str:
    c = r.cfg
    plan = predict(Workload.from_sim(c))
    rss = r.rss_mb
    rows = [
        ("controller CPU per trained group", f"{r.cpu_per_group_us:,.0f} us", "", "", ""),
        ("controller share of one core", f"{r.core_fraction:.3f}", f"limit {CORE_LIMIT}",
         f"{r.core_fraction / CORE_LIMIT:.2f}x", f"{r.core_fraction / CORE_LIMIT:.0%} of the limit"),
        ("samples/s (trained)", f"{r.samples_per_s:,.1f}", f"plan {plan.samples_per_s:,.1f}",
         f"{r.samples_per_s / plan.samples_per_s:.2f}x", f"{r.samples_per_s / plan.rollout_ceiling:.0%} of the "
         f"engines' ceiling ({plan.rollout_ceiling:,.0f})"),
        ("trainer busy (stepping)", f"{r.trainer_busy:.1%}", f"plan {plan.trainer_util:.1%}", "", ""),
        ("trainer idle per step", _ms(r.trainer_idle_s), "", "", ""),
        ("mean staleness (versions)", f"{r.mean_staleness:.2f}", f"plan {plan.mean_staleness:.2f}", "",
         f"bound {c.max_staleness}"),
        ("staleness: samples per versions behind", ", ".join(f"{k}: {v:,}" for k, v in r.staleness.items()), "", "",
         ""),
        ("group done -> controller has it, p50 / p99 / max",
         f"{_ms(r.collect.quantile(.5))} / {_ms(r.collect.quantile(.99))} / {_ms(r.collect.max)}", "", "", ""),
        ("lease -> result, p50 / p99", f"{_ms(r.group_latency.quantile(.5))} / {_ms(r.group_latency.quantile(.99))}",
         f"plan {_ms(plan.group_latency_s)} (mean)", "", ""),
        ("queued -> leased, p50 / p99", f"{_ms(r.queue_wait.quantile(.5))} / {_ms(r.queue_wait.quantile(.99))}",
         "", "", ""),
        ("resident memory: after 1/10 of the run -> end", f"{_first_after_tenth(r):,.0f} -> {rss[-1][1]:,.0f} MB",
         "", "", f"growth {r.rss_growth_mb():+,.1f} MB"),
        ("garbage collection pauses (whole process)", f"{r.gc_pause_s:,.2f} s", "", "", ""),
        ("preemptions, handed back, stale dropped",
         f"{r.fleet_counts['preempted']}, {r.counters['preempted']}, {r.counters['stale_dropped']}", "", "", ""),
    ]
    head = ["metric", "moerl (simulated fleet)", "reference", "ratio", "of limit"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _first_after_tenth(r: FleetReport) -> float:
    return next(mb for groups, mb in r.rss_mb if groups >= r.cfg.groups // 10)


def main(argv: list[str] | None = None) -> int:
    args = parser("fleet").parse_args(argv)
    try:
        counts = [int(n) for n in args.engines.split(",")]
    except ValueError:
        print(f"moerl bench fleet: --engines takes a comma list of counts, got {args.engines!r}", file=sys.stderr)
        return 2
    for engines in counts:
        cfg = config(args, engines)
        try:
            report = simulate(cfg)
        except ValueError as e:
            print(f"moerl bench fleet: {e}", file=sys.stderr)
            return 2
        print(f"\n{engines} engines, {report.steps} steps of {cfg.batch_groups} groups x {cfg.group_size} "
              f"({cfg.lengths} lengths up to {cfg.max_new_tokens} new tokens), max_staleness {cfg.max_staleness}, "
              f"preemptions {cfg.preempt_per_hour:g}/engine-hour; measured after the first tenth of the steps; "
              f"{report.sim_s:,.0f} simulated s in {report.wall_s:,.0f} s wall, simulator CPU "
              f"{report.sim_cpu_s:,.1f} s; {datetime.date.today()}")
        print(table(report))
        changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                   if getattr(cfg, f.name) != getattr(FleetSimConfig(), f.name) and f.name != "engine"}
        print(f"settings other than the defaults: {changed or 'none'}; engine {cfg.engine}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
