"""The model behind `moerl bench plan` (moerl/bench/plan_report.py prints it): size a fleet before renting it.
From a model shape, a node kind and counts, and per-GPU rates (defaults: BENCHMARKS.md's H200 figures; pass your
own `moerl bench rollout` / `bench train` numbers), it predicts samples/s, trainer utilisation, mean staleness
and the publish time of one weight version per transport across nodes, and recommends a rollout:trainer split.
(`moerl launch`'s planner of manifests is moerl/launch/plan.py; this one plans capacity.) Closed forms, stated
where they are used:

- engine: a decode step of r rows takes a + b*r (the line through two measured points: 30B on an H200, 20.23 ms
  at 64 requests and 23.97 ms at 256); it decodes r / (a + b*r) tok/s.
- rows an engine holds: r = min(max_batch, inflight_per_engine * G * occ, N_fly * G * occ / engines), where
  occ = E[L] / E[max of G lengths] (a group holds its slots until its longest sample ends: on average occ of its G
  sequences are still decoding) and N_fly = (S + 1/2 - u) * B groups in flight when the staleness gate binds
  (the gate admits (S + 1) * B groups not yet trained; about half a batch waits ready and u * B trains).
- rollout: X_r = engines * r / ((a + b*r) * G * E[L]) groups/s; a group takes T_g = E[max L] * (a + b*r).
- trainer: a step takes T_s = fixed + B * G * (prompt + E[L]) / train_tok_s, then the publish: X_t = B / (T_s + P).
- throughput X = min(X_r * (1 - dropped), X_t); trainer utilisation u = X * T_s / B.
- staleness (Applied Compute, "staleness in fully async RL": with a pipeline, mean staleness is the rollout time
  counted in versions): a group leased at phase f (uniform in [0, 1)) of a version period T_p = B / X and ready
  after T seconds is trained floor(f + T / T_p) versions behind; over S it is dropped. Evaluated over the length
  distribution's group maxima (T = max L * step), iterated with X to a fixed point. Trainer-bound, the gate stays
  full and every group waits behind S batches: staleness S, nothing dropped.

Publish per version, V = 2 bytes x parameters, n rollout nodes of g GPUs, per node EFA bandwidth E, per GPU E / g,
link efficiency e (NCCL reaches ~80% of a link), a node's NVLink per GPU N, TCP per node for Ray's object store:
    object-store        the source node sends V to each rollout node (Ray pulls one copy per node): n * V / TCP
    nccl-broadcast      one ring over every engine's GPU, one channel per NIC: V / (E * e)
    node-broadcast-ipc  a broadcast to one GPU per node (its own NICs: E / g), then the other g - 1 read it over
                        CUDA IPC (its NVLink): V / (E / g * e) + (g - 1) * V / N, pipelined per bucket: the larger
    node-sharded-ipc    each GPU of a node receives V / g on its own NICs, then an all-gather over NVLink:
                        V / (E * e) + (g - 1) / g * V / N
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moerl.bench.fleet_model import length_table

DATASHEET_BF16 = 990e12  # H200 SXM dense bf16 FLOP/s
TRAIN_MFU = 0.224  # `moerl bench train`, H200, 2cb0def: 22.4% of the datasheet (the 0.9B shape; no 30B step measured)


@dataclass(frozen=True)
class ModelShape:
    params: float  # all parameters
    active: float  # per token


@dataclass(frozen=True)
class NodeKind:
    gpus: int
    efa_gbps: float  # the node's EFA bandwidth, all NICs
    nvlink_gbs: float  # one GPU's NVLink bandwidth, one direction, GB/s
    gpu_mem_gb: float


MODELS = {"qwen3-30b-a3b": ModelShape(30.5e9, 3.3e9), "qwen3-235b-a22b": ModelShape(235e9, 22e9)}
NODES = {"p5en.48xlarge": NodeKind(8, 3200, 450, 141), "p5.48xlarge": NodeKind(8, 3200, 450, 80)}
TRANSPORTS = ("object-store", "nccl-broadcast", "node-broadcast-ipc", "node-sharded-ipc")


@dataclass(frozen=True)
class Workload:
    engines: int
    batch_groups: int
    group_size: int
    max_staleness: int
    inflight_per_engine: int
    prompt_len: int
    max_new_tokens: int
    lengths: str
    step_base_s: float
    step_row_s: float
    max_batch: int
    train_tok_s: float
    step_fixed_s: float
    publish_s: float
    transfer_s: float

    @classmethod
    def from_sim(cls, c) -> Workload:  # a FleetSimConfig (moerl/bench/fleet_sim.py)
        e = c.engine
        return cls(c.engines, c.batch_groups, c.group_size, c.max_staleness, c.inflight_per_engine, c.prompt_len,
                   c.max_new_tokens, c.lengths, e.step_base_s, e.step_row_s, e.max_batch, c.train_tok_s,
                   c.step_fixed_s, c.publish_s, c.transfer_s)


@dataclass(frozen=True)
class Prediction:
    samples_per_s: float
    rollout_ceiling: float  # samples/s with every engine at max_batch
    trainer_ceiling: float  # samples/s the trainer could take
    trainer_util: float
    mean_staleness: float
    dropped: float  # share of finished groups dropped as stale
    rows_per_engine: float
    group_latency_s: float
    bound: str  # "trainer", "gate" or "engines"


def _group_maxima(w: Workload) -> tuple[float, np.ndarray]:
    table = length_table(w.lengths, w.max_new_tokens, seed=0)
    groups = table[: len(table) // w.group_size * w.group_size].reshape(-1, w.group_size)
    return float(table.mean()), groups.max(axis=1).astype(np.float64)


def predict(w: Workload) -> Prediction:
    mean_len, maxima = _group_maxima(w)
    occ = mean_len / maxima.mean()
    B, G, S = w.batch_groups, w.group_size, w.max_staleness
    step_s = w.step_fixed_s + B * G * (w.prompt_len + mean_len) / w.train_tok_s
    x_train = B / (step_s + w.publish_s)
    rows_full = w.max_batch
    ceiling = w.engines * rows_full / ((w.step_base_s + w.step_row_s * rows_full) * mean_len)
    phase = (np.arange(len(maxima)) + 0.5) / len(maxima)
    util, x, dropped, staleness = 0.0, x_train, 0.0, 0.0
    for _ in range(50):  # fixed point of (throughput, trainer utilisation, drops)
        rows_gate = max(0.5, S + 0.5 - util) * B * G * occ / w.engines
        rows = min(w.max_batch, w.inflight_per_engine * G * occ, rows_gate)
        step = w.step_base_s + w.step_row_s * rows
        x_roll = w.engines * rows / (step * G * mean_len)
        behind = np.floor(phase + (maxima * step + w.transfer_s) / (B / x))
        kept = behind <= S
        dropped = 1.0 - kept.mean()
        staleness = float(behind[kept].mean()) if kept.any() else float(S)
        x_new = min(x_roll * (1 - dropped), x_train)
        util = x_new * step_s / B
        x = 0.5 * (x + x_new)
    bound = "trainer" if x_train <= x_roll * (1 - dropped) else ("gate" if rows_gate < min(
        w.max_batch, w.inflight_per_engine * G * occ) else "engines")
    if bound == "trainer":  # the gate stays full: every group waits its turn behind S batches, none is dropped
        staleness, dropped = float(S), 0.0
    return Prediction(x * G, ceiling, x_train * G, util, staleness, dropped, rows, float(maxima.mean() * step), bound)


def publish_times(model: ModelShape, node: NodeKind, rollout_nodes: int, efficiency: float,
                  tcp_gbps: float) -> dict[str, float]:
    """Seconds for one version to reach every rollout engine, per transport (module docstring)."""
    v = 2 * model.params  # bytes in bf16
    efa, gpu_efa, nvl = node.efa_gbps / 8 * 1e9, node.efa_gbps / 8 * 1e9 / node.gpus, node.nvlink_gbs * 1e9
    return {"object-store": rollout_nodes * v / (tcp_gbps / 8 * 1e9),
            "nccl-broadcast": v / (efa * efficiency),
            "node-broadcast-ipc": max(v / (gpu_efa * efficiency), (node.gpus - 1) * v / nvl),
            "node-sharded-ipc": v / (efa * efficiency) + (node.gpus - 1) / node.gpus * v / nvl}


def train_tok_s_per_gpu(model: ModelShape) -> float:
    """6 x active parameters per token at the MFU `moerl bench train` measured (an estimate for other shapes)."""
    return TRAIN_MFU * DATASHEET_BF16 / (6 * model.active)


def decode_line(tok_s: float, rows: int, tok_s_small: float, rows_small: int) -> tuple[float, float]:
    """(a, b) of step(r) = a + b*r through two measured (rows, tok/s) points."""
    step, step_small = rows / tok_s, rows_small / tok_s_small
    b = (step - step_small) / (rows - rows_small)
    return step - b * rows, b

