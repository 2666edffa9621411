"""`moerl bench plan`: size a fleet before renting it. From a model shape, a node kind and counts, and per-GPU rates
(defaults: BENCHMARKS.md's H200 figures; pass your own `moerl bench rollout` / `bench train` numbers, or --config
for a moerl config's workload and nodes), it prints the predicted samples/s, trainer utilisation and mean
staleness, the publish time of one weight version per transport across nodes, the split of the same nodes that
predicts the most samples/s, and the engine model's check against the one-H200 measurements it starts from.
The closed forms (and the formula for staleness) are in moerl/bench/plan.py's docstring; docs/eks.md has a worked
example for configs/eks-p5en.toml.

    moerl bench plan --config configs/eks-p5en.toml
    moerl bench plan --trainer-nodes 8 --rollout-nodes 40 --max-staleness 4 --decode-tok-s 9500
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from moerl.bench.options import parser
from moerl.bench.plan import (MODELS, NODES, TRANSPORTS, ModelShape, NodeKind, Prediction, Workload, decode_line,
                              predict, publish_times, train_tok_s_per_gpu)

STATE_BYTES_PER_PARAM = 16  # bf16 weights + fp32 master + AdamW's two fp32 moments (configs/eks-p5en.toml)
TRAINER_MEMORY_SHARE = 0.6  # of the nodes' GPU memory for that state; the rest is activations and buffers


def _from_config(args: argparse.Namespace) -> None:
    """--config: the workload and node counts from a moerl config; a flag given on the command line wins."""
    from moerl.config import MoerlConfig
    from moerl.config_loader import load_config

    cfg = load_config(args.config, [], MoerlConfig)
    found = {"batch_groups": cfg.train.batch_groups, "group_size": cfg.rollout.group_size,
             "max_staleness": cfg.train.max_staleness, "max_new_tokens": cfg.rollout.max_new_tokens,
             "inflight_per_engine": cfg.rollout.inflight_groups(), "max_batch": cfg.rollout.max_batch_size}
    if cfg.launch.rollout_nodes:
        found.update(trainer_nodes=cfg.launch.trainer_nodes, rollout_nodes=cfg.launch.rollout_nodes,
                     node=cfg.launch.rollout_instance_type or cfg.launch.instance_type)
    defaults = parser("plan")
    for name, value in found.items():
        if getattr(args, name) == defaults.get_default(name):
            setattr(args, name, value)


def min_trainer_nodes(model: ModelShape, node: NodeKind) -> int:
    return max(1, math.ceil(STATE_BYTES_PER_PARAM * model.params / (TRAINER_MEMORY_SHARE * node.gpus
                                                                    * node.gpu_mem_gb * 1e9)))


def workload(args: argparse.Namespace, model: ModelShape, node: NodeKind, trainer_nodes: int, rollout_nodes: int,
             publish_s: float) -> Workload:
    a, b = decode_line(args.decode_tok_s, args.decode_rows, args.decode_tok_s_small, args.decode_rows_small)
    per_gpu = args.train_tok_s_per_gpu or train_tok_s_per_gpu(model)
    return Workload(rollout_nodes * node.gpus, args.batch_groups, args.group_size, args.max_staleness,
                    args.inflight_per_engine, args.prompt_len, args.max_new_tokens, args.lengths, a, b,
                    args.max_batch, per_gpu * trainer_nodes * node.gpus, 0.5, publish_s, publish_s)


def run(args: argparse.Namespace) -> str:
    if args.config:
        _from_config(args)
    if args.model not in MODELS:
        raise ValueError(f"--model {args.model!r} is not a known shape (known: {', '.join(MODELS)})")
    if args.node not in NODES:
        raise ValueError(f"--node {args.node!r} is not a known node kind (known: {', '.join(NODES)})")
    if args.trainer_nodes < 1 or args.rollout_nodes < 1:
        raise ValueError(f"--trainer-nodes and --rollout-nodes must be >= 1, got {args.trainer_nodes}, "
                         f"{args.rollout_nodes}")
    model, node = MODELS[args.model], NODES[args.node]
    publish = publish_times(model, node, args.rollout_nodes, args.efficiency, args.tcp_gbps)
    publish_s = args.publish_s if args.publish_s >= 0 else publish[args.transport]
    w = workload(args, model, node, args.trainer_nodes, args.rollout_nodes, publish_s)
    p = predict(w)
    out = [f"{args.model} ({model.params / 1e9:.1f}B parameters, {2 * model.params / 1e9:.0f} GB per version in "
           f"bf16), {args.trainer_nodes} trainer + {args.rollout_nodes} rollout {args.node} nodes "
           f"({w.engines} engines); batch {w.batch_groups} groups x {w.group_size}, max_staleness {w.max_staleness}, "
           f"{w.lengths} lengths up to {w.max_new_tokens}; decode step {w.step_base_s * 1e3:.2f} ms + "
           f"{w.step_row_s * 1e6:.1f} us/row; trainer {w.train_tok_s / (args.trainer_nodes * node.gpus):,.0f} "
           f"tok/s per GPU; publish {publish_s:.2f} s ({args.transport})", "",
           "| prediction | value | note |", "| --- | --- | --- |"]
    out += _rows(p, w)
    out += ["", "| weight transport (one version to every engine) | seconds | note |", "| --- | --- | --- |"]
    notes = {"object-store": f"{args.rollout_nodes} copies out of the source node at {args.tcp_gbps:g} Gbps TCP",
             "nccl-broadcast": f"{node.efa_gbps:g} Gbps EFA per node at {args.efficiency:.0%}",
             "node-broadcast-ipc": f"one GPU's NICs ({node.efa_gbps / node.gpus:g} Gbps), then "
                                   f"{node.gpus - 1} reads over its NVLink ({node.nvlink_gbs:g} GB/s)",
             "node-sharded-ipc": "1/g per GPU over its own NICs, then an NVLink all-gather"}
    out += [f"| {t} | {publish[t]:.2f} | {notes[t]} |" for t in TRANSPORTS]
    out += ["", _split(args, model, node, publish), "", _check(args)]
    return "\n".join(out)


def _rows(p: Prediction, w: Workload) -> list[str]:
    return [f"| samples/s | {p.samples_per_s:,.0f} | bound by the {p.bound} |",
            f"| rollout ceiling (every engine at {w.max_batch} rows) | {p.rollout_ceiling:,.0f} samples/s | "
            f"{p.samples_per_s / p.rollout_ceiling:.0%} of it used |",
            f"| trainer ceiling | {p.trainer_ceiling:,.0f} samples/s | |",
            f"| trainer utilisation | {p.trainer_util:.0%} | |",
            f"| rows per engine | {p.rows_per_engine:,.1f} of {w.max_batch} | |",
            f"| group latency (lease -> done) | {p.group_latency_s:,.1f} s | |",
            f"| mean staleness | {p.mean_staleness:.2f} versions | {p.dropped:.0%} of finished groups dropped "
            f"as stale (bound {w.max_staleness}) |"]


def _split(args: argparse.Namespace, model: ModelShape, node: NodeKind, publish: dict[str, float]) -> str:
    """Every split of the same node count (the trainer at least what its state needs): the best by samples/s."""
    total, least = args.trainer_nodes + args.rollout_nodes, min_trainer_nodes(model, node)
    best = None
    for trainer_nodes in range(least, total):
        rollout_nodes = total - trainer_nodes
        times = publish_times(model, node, rollout_nodes, args.efficiency, args.tcp_gbps)
        p = predict(workload(args, model, node, trainer_nodes, rollout_nodes,
                             args.publish_s if args.publish_s >= 0 else times[args.transport]))
        if best is None or p.samples_per_s > best[2].samples_per_s * 1.01:  # ties go to fewer trainer nodes
            best = (trainer_nodes, rollout_nodes, p)
    t, r, p = best
    line = ""
    if p.bound == "gate":  # more engines or trainer GPUs change nothing: the staleness bound holds the work back
        wider = [(s, predict(dataclasses.replace(workload(args, model, node, t, r, publish[args.transport]),
                                                 max_staleness=s))) for s in (2, 4, 8) if s > args.max_staleness]
        line = ("; the staleness gate, not the split, limits it: with max_staleness " + ", ".join(
            f"{s} -> {q.samples_per_s:,.0f} samples/s (staleness {q.mean_staleness:.1f})" for s, q in wider))
    return (f"recommended split of {total} nodes (the trainer needs at least {least} for its {STATE_BYTES_PER_PARAM} "
            f"bytes/parameter): {t} trainer + {r} rollout -> {p.samples_per_s:,.0f} samples/s, trainer "
            f"{p.trainer_util:.0%} busy, staleness {p.mean_staleness:.2f}, bound by the {p.bound}" + line)


def _check(args: argparse.Namespace) -> str:
    """The engine line against BENCHMARKS.md's one-H200 `bench rollout --preset qwen3-30b-a3b` (2cb0def)."""
    a, b = decode_line(args.decode_tok_s, args.decode_rows, args.decode_tok_s_small, args.decode_rows_small)
    rows = ["| one H200, 30B shape (`bench rollout`, 2cb0def) | plan | measured | ratio |", "| --- | --- | --- | --- |"]
    for r, measured in ((256, 10_680.0), (64, 3_163.0)):
        tok_s = r / (a + b * r)
        rows.append(f"| decode tok/s at {r} requests | {tok_s:,.0f} | {measured:,.0f} | {tok_s / measured:.2f}x |")
    return "\n".join(rows)



def main(argv: list[str] | None = None) -> int:
    args = parser("plan").parse_args(argv)
    try:
        print(run(args))
    except ValueError as e:
        print(f"moerl bench plan: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
