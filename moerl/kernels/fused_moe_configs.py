"""The block-config table of the fused MoE decode kernels (moerl/kernels/triton_fused_moe.py): one `KernelConfig`
per kernel, expert shape and bucket of tokens per call, fitted to the shared memory of a block; and the bound on
row blocks that the alignment's reference (fused_moe.py) and its kernel share. Plain Python, no torch: the
kernels, their torch side and `moerl bench moe-decode --tune` all read it, and it imports none of them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple


class KernelConfig(NamedTuple):
    """One kernel's launch: row block (BLOCK_M pairs of one expert), output columns, reduction step, pid
    grouping over row blocks (1 = none), warps, software-pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# Buckets of T (tokens per call) with a config each; decode batches are 1..512 rows.
M_BUCKETS = ("1", "2-16", "17-64", "65-256", "257+")


def m_bucket(T: int) -> str:
    return "1" if T <= 1 else "2-16" if T <= 16 else "17-64" if T <= 64 else "65-256" if T <= 256 else "257+"


# (E, D, I) -> kernel ("gate_up": x @ [gate|up]^T with SwiGLU, "down": h @ down^T) -> bucket -> config tuple.
# Starting points from vLLM's tuned H100/H200 tables for E=128,N=768 and E=128,N=256 (their BLOCK_N spans gate
# and up interleaved, so half of it here, where one tile loads both) sized for H100/H200 shared memory;
# `moerl bench moe-decode --tune` prints a measured replacement for this literal.
_CONFIGS: dict[tuple[int, int, int], dict[str, dict[str, tuple[int, ...]]]] = {
    # tuned on one H200 by `moerl bench moe-decode --tune` (2026-12-04, at ee4f447; BENCHMARKS.md)
    (128, 2048, 768): {  # Qwen3-30B-A3B (top-8)
        "gate_up": {"1": (16, 32, 256, 1, 4, 3), "2-16": (16, 32, 256, 1, 4, 3), "17-64": (16, 32, 256, 1, 4, 3),
                    "65-256": (32, 64, 128, 8, 4, 2), "257+": (64, 64, 64, 1, 4, 3)},
        "down": {"1": (16, 64, 128, 1, 4, 5), "2-16": (16, 128, 128, 1, 4, 3), "17-64": (16, 128, 128, 1, 4, 3),
                 "65-256": (32, 128, 128, 1, 4, 3), "257+": (64, 64, 64, 8, 4, 3)},
    },
    (64, 1024, 256): {  # the 0.92B bench preset (top-8)
        "gate_up": {"1": (16, 32, 256, 1, 4, 4), "2-16": (16, 32, 64, 1, 4, 3), "17-64": (16, 64, 128, 1, 4, 3),
                    "65-256": (64, 64, 64, 1, 4, 3), "257+": (64, 64, 64, 1, 4, 3)},
        "down": {"1": (16, 64, 128, 8, 4, 3), "2-16": (16, 64, 64, 8, 4, 2), "17-64": (16, 256, 64, 1, 4, 4),
                 "65-256": (64, 64, 64, 8, 4, 3), "257+": (64, 128, 64, 8, 4, 3)},
    },
}
_DEFAULT_SHAPE = (128, 2048, 768)  # other shapes: the 30B-A3B entries, clamped to the dims below


def _clamp(cfg: KernelConfig, n_dim: int, k_dim: int) -> KernelConfig:
    """No tile wider than its (power-of-two rounded) dimension: small test shapes waste no masked work."""
    fit = lambda block, dim: max(16, min(block, 1 << max(0, dim - 1).bit_length()))  # noqa: E731
    return cfg._replace(block_n=fit(cfg.block_n, n_dim), block_k=fit(cfg.block_k, k_dim))


SHARED_MEMORY_BYTES = 200 * 1024  # H100/H200 allow 227 KB per block; Triton needs some beside the pipeline


def shared_memory(cfg: KernelConfig, weight_tiles: int, element_size: int) -> int:
    """Bytes of the software pipeline: num_stages copies of the activation tile and the weight tile(s)."""
    return cfg.num_stages * (cfg.block_m + weight_tiles * cfg.block_n) * cfg.block_k * element_size


def _fit(cfg: KernelConfig, weight_tiles: int, element_size: int, budget: int) -> KernelConfig:
    """Fewer stages, then a shorter reduction step, until the pipeline fits (float32 doubles the bf16 tiles)."""
    while shared_memory(cfg, weight_tiles, element_size) > budget:
        if cfg.num_stages > 2:
            cfg = cfg._replace(num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 32:
            cfg = cfg._replace(block_k=cfg.block_k // 2)
        else:
            break
    return cfg


def fused_moe_configs(E: int, D: int, I: int, T: int, element_size: int = 2,
                      shared_memory_bytes: int = SHARED_MEMORY_BYTES) -> tuple[KernelConfig, KernelConfig]:
    """(gate_up config, down config) for this shape, number of tokens, activation element size and shared memory
    per block (a smaller GPU's fits by fewer stages)."""
    return _configs(E, D, I, m_bucket(T), element_size, shared_memory_bytes)


@functools.lru_cache(maxsize=256)
def _configs(E: int, D: int, I: int, bucket: str, element_size: int, budget: int) -> tuple[KernelConfig, KernelConfig]:
    table = _CONFIGS.get((E, D, I), _CONFIGS[_DEFAULT_SHAPE])
    gate_up = _fit(_clamp(KernelConfig(*table["gate_up"][bucket]), I, D), 2, element_size, budget)
    down = _fit(_clamp(KernelConfig(*table["down"][bucket]), D, I), 1, element_size, budget)
    return gate_up, down


def max_row_blocks(M: int, E: int, block_m: int) -> int:
    """Row blocks the alignment may need, from sizes alone: each used expert pads to whole blocks, so at most
    cdiv(M, BLOCK_M) + (experts used) blocks, and never more than M (a block holds at least one pair)."""
    return min((M + block_m - 1) // block_m + min(E, M), M)
