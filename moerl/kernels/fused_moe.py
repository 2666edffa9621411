"""The fused MoE decode path: align pairs by expert without a sort, then two grouped GEMM kernels that gather
token rows themselves (moerl/kernels/triton_fused_moe.py), then the training path's combine.

Shape legend: T tokens, K slots per token, M = T*K (token, slot) pairs, E experts, D hidden, I expert
intermediate, S = B*BLOCK_M aligned rows (B row blocks).

Torch only: the alignment reference, the numerics reference of the whole path and the dispatching wrapper (the
block-config table is fused_moe_configs.py, which the kernels import too). Numerics match the training path
(grouped_mm -> swiglu -> grouped_mm -> combine): the gate and up projections are rounded to the activation dtype
before the float32 SwiGLU, h and the down projection's output are stored in the activation dtype, and the K
slots are mixed in float32 with one rounding at the end.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from moerl.kernels.fused_moe_configs import SHARED_MEMORY_BYTES, KernelConfig, fused_moe_configs, max_row_blocks

_TRITON = importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=16)
def _shared_memory_budget(device_index: int) -> int:
    """The table's budget, or less on a GPU with less shared memory per block (8 KB left to Triton's own use)."""
    props = torch.cuda.get_device_properties(device_index)
    return min(SHARED_MEMORY_BYTES, getattr(props, "shared_memory_per_block_optin", 232448) - 8 * 1024)


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
