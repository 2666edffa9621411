"""The fused MoE decode path: align pairs by expert without a sort, then two grouped GEMM kernels that gather
token rows themselves (moerl/kernels/triton_fused_moe.py), then the training path's combine.

Shape legend: T tokens, K slots per token, M = T*K (token, slot) pairs, E experts, D hidden, I expert
intermediate, S = B*BLOCK_M aligned rows (B row blocks).

Torch only: the alignment reference, the numerics reference of the whole path, the dispatching wrapper and the
block-config table. Numerics match the training path (grouped_mm -> swiglu -> grouped_mm -> combine): the gate
and up projections are rounded to the activation dtype before the float32 SwiGLU, h and the down projection's
output are stored in the activation dtype, and the K slots are mixed in float32 with one rounding at the end.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import torch
import torch.nn.functional as F

_TRITON = importlib.util.find_spec("triton") is not None


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


@functools.lru_cache(maxsize=16)
def _shared_memory_budget(device_index: int) -> int:
    """The table's budget, or less on a GPU with less shared memory per block (8 KB left to Triton's own use)."""
    props = torch.cuda.get_device_properties(device_index)
    return min(SHARED_MEMORY_BYTES, getattr(props, "shared_memory_per_block_optin", 232448) - 8 * 1024)


def max_row_blocks(M: int, E: int, block_m: int) -> int:
    """Row blocks the alignment may need, from sizes alone: each used expert pads to whole blocks, so at most
    cdiv(M, BLOCK_M) + (experts used) blocks, and never more than M (a block holds at least one pair)."""
    return min((M + block_m - 1) // block_m + min(E, M), M)


def moe_align_reference(topk_idx_TK: torch.Tensor, num_experts: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the M = T*K pairs by expert without a sort (one-hot prefix counts), padded per expert to BLOCK_M.

    Returns pair_S (int32 pair id t*K+k of each aligned row, M where padding), expert_B (int32 expert of each
    row block, -1 past the valid blocks) and num_blocks (int32 [1]: valid blocks). Tokens of one expert keep
    token order. Fixed sizes from (T, K, E, BLOCK_M) and no host sync: capturable in a CUDA graph.
    """
    flat_M = topk_idx_TK.reshape(-1).long()
    M, device = flat_M.numel(), flat_M.device
    B = max_row_blocks(M, num_experts, block_m)
    onehot_ME = F.one_hot(flat_M, num_experts).to(torch.int32)
    rank_M = (onehot_ME.cumsum(0) * onehot_ME).sum(1) - 1  # earlier pairs of the same expert: stable
    blocks_E = (onehot_ME.sum(0) + block_m - 1) // block_m
    block_end_E = blocks_E.cumsum(0)
    pos_M = (block_end_E - blocks_E)[flat_M] * block_m + rank_M
    pair_S = torch.full((B * block_m,), M, dtype=torch.int32, device=device)
    pair_S[pos_M] = torch.arange(M, dtype=torch.int32, device=device)
    num_blocks = block_end_E[-1:].to(torch.int32)
    b_B = torch.arange(B, device=device)
    expert_B = torch.searchsorted(block_end_E, b_B.to(block_end_E.dtype), right=True).to(torch.int32)
    return pair_S, torch.where(b_B < num_blocks, expert_B, -1), num_blocks


@torch.no_grad()
def fused_moe_reference(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, w_TK: torch.Tensor,
                        gate_up_EFD: torch.Tensor, down_EDI: torch.Tensor) -> torch.Tensor:
    """The fused path's arithmetic in torch, any device and dtype: per-expert matmuls with the same roundings
    (one host sync per expert: a reference, not a decode path)."""
    T, K = topk_idx_TK.shape
    I = down_EDI.shape[2]
    acc = torch.promote_types(x_TD.dtype, torch.float32)
    y_MD = x_TD.new_zeros(T * K, x_TD.shape[1])
    flat_M = topk_idx_TK.reshape(-1)
    for e in torch.unique(flat_M).tolist():
        pairs_n = torch.nonzero(flat_M == e).squeeze(1)
        gu_nF = x_TD.index_select(0, pairs_n // K) @ gate_up_EFD[e].T  # rounded to the activation dtype
        gate_nI, up_nI = gu_nF[:, :I].to(acc), gu_nF[:, I:].to(acc)
        h_nI = (F.silu(gate_nI) * up_nI).to(x_TD.dtype)
        y_MD[pairs_n] = h_nI @ down_EDI[e].T
    out_TD = (y_MD.view(T, K, -1).to(acc) * w_TK.to(acc).unsqueeze(-1)).sum(1)
    return out_TD.to(x_TD.dtype)


def fused_moe_unavailable(x_TD: torch.Tensor) -> str | None:
    """Why the Triton fused path cannot run on x_TD, or None when it can."""
    if not _TRITON:
        return "triton is not installed"
    if not x_TD.is_cuda:
        return f"it needs a CUDA tensor, got {x_TD.device}"
    if x_TD.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"it runs bf16/fp16/fp32 activations, got {x_TD.dtype}"
    return None


def fused_moe(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, w_TK: torch.Tensor, gate_up_EFD: torch.Tensor,
              down_EDI: torch.Tensor, configs: tuple[KernelConfig, KernelConfig] | None = None) -> torch.Tensor:
    """out_TD[t] = sum_k w_TK[t, k] * expert_{idx[t, k]}(x_TD[t]) by the Triton kernels (no autograd).

    topk_idx_TK must hold expert ids in [0, E) (no dropped pairs); configs default to the table's."""
    reason = fused_moe_unavailable(x_TD)
    if reason is not None:
        raise ValueError(f"the fused MoE path cannot run here: {reason}")
    from moerl.kernels.triton_fused_moe import fused_moe_triton

    E, D, I = down_EDI.shape[0], down_EDI.shape[1], down_EDI.shape[2]
    budget = _shared_memory_budget(x_TD.device.index if x_TD.device.index is not None else 0)
    configs = configs or fused_moe_configs(E, D, I, x_TD.shape[0], x_TD.element_size(), budget)
    return fused_moe_triton(x_TD, topk_idx_TK, w_TK, gate_up_EFD, down_EDI, *configs)


# Token counts the self-check runs: one per M bucket, so every configuration the table gives this shape compiles.
_CHECK_TOKENS = (1, 5, 40, 200, 300)


@torch.no_grad()
def fused_moe_self_check(gate_up_EFD: torch.Tensor, down_EDI: torch.Tensor, top_k: int) -> str | None:
    """None when the Triton path matches `fused_moe_reference` on these weights at one token count per M bucket,
    else why not (a compile or launch error, or the relative error). Run eagerly, once per shape, before any decode
    graph is captured: a kernel that fails leaves the block on the grouped GEMM path instead of wrong experts."""
    E, D = down_EDI.shape[0], down_EDI.shape[1]
    gen = torch.Generator(device=gate_up_EFD.device).manual_seed(0)
    try:
        for T in _CHECK_TOKENS:
            x_TD = torch.randn(T, D, generator=gen, device=gate_up_EFD.device).to(gate_up_EFD.dtype)
            idx_TK = torch.rand(T, E, generator=gen, device=x_TD.device).topk(min(top_k, E), dim=-1).indices
            w_TK = torch.softmax(torch.randn(idx_TK.shape, generator=gen, device=x_TD.device), -1).to(x_TD.dtype)
            got_TD = fused_moe(x_TD, idx_TK, w_TK, gate_up_EFD, down_EDI).float()
            want_TD = fused_moe_reference(x_TD, idx_TK, w_TK, gate_up_EFD, down_EDI).float()
            err = float((got_TD - want_TD).norm() / want_TD.norm().clamp_min(1e-30))
            if not err <= (1e-4 if x_TD.dtype == torch.float32 else 2e-2):
                return f"at {T} tokens it differs from its reference by {err:.2e} (relative)"
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: the grouped path still computes right
        return f"it failed at {T} tokens: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return None
