"""What the fleet simulator (moerl/bench/fleet_sim.py) and `moerl bench plan` (moerl/bench/plan.py) share: one
engine's decode pace and batch, and the completion lengths drawn for every sample."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TOKEN = 7  # every generated token id: lengths are real, ids need not be
LENGTH_TABLE = 1 << 18  # lengths drawn once; sample i of prompt p reads entry (p * G + i) mod this


@dataclass(frozen=True)
class EngineModel:
    """One engine's decode pace and batch: the 30B shape on one H200 by default (BENCHMARKS.md, `bench rollout
    --preset qwen3-30b-a3b`: 20.23 ms per step at 64 requests, 23.97 ms at 256; the line through both)."""

    step_base_s: float = 0.01898
    step_row_s: float = 0.0000195
    max_batch: int = 256
    apply_s: float = 0.05  # decode paused per version (a device-local copy of the staged weights)
    respawn_s: float = 300.0  # a replacement's node, image and weights: spot capacity is not instant

    def step_s(self, rows: int) -> float:
        return self.step_base_s + self.step_row_s * rows


def length_table(kind: str, max_new_tokens: int, seed: int) -> np.ndarray:
    """Completion lengths. `config`: lognormal, median max_new_tokens / 4, sigma 0.5 (few reach the cap);
    `long-tail`: median max_new_tokens / 8, sigma 1.2 (a tenth run to the cap, as reasoning traces do);
    `fixed`: every sample max_new_tokens. Clipped to [1, max_new_tokens]."""
    rng = np.random.default_rng(seed)
    if kind == "fixed":
        return np.full(LENGTH_TABLE, max_new_tokens, np.int64)
    median, sigma = {"config": (max_new_tokens / 4, 0.5), "long-tail": (max_new_tokens / 8, 1.2)}[kind]
    return np.clip(rng.lognormal(math.log(median), sigma, LENGTH_TABLE), 1, max_new_tokens).astype(np.int64)
