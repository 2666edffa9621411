"""Triton kernels of the fused MoE decode path (fused_moe.py holds the references, fused_moe_configs.py the
configs).

Shape legend: T tokens, K slots per token, M = T*K (token, slot) pairs, E experts, D hidden, I expert
intermediate, C alignment chunks, B row blocks of BLOCK_M aligned rows, S = B*BLOCK_M.

    pair_S, expert_B, num_blocks = moe_align(topk_idx_TK, E, BLOCK_M)   # 2 launches, no sort, no host sync
    h_MI = silu(round(x[t] @ gate[e]^T)) * round(x[t] @ up[e]^T)          # kernel 1, rows gathered from x_TD
    y_MD = h_MI @ down[e]^T                                               # kernel 2
    out_TD = sum_k w[t, k] * y[t*K + k]                                   # triton_moe.gather_weighted_sum

Every grid is sized from (T, K, E, BLOCK_M) alone; programs past the valid row blocks (a device tensor) exit
at once, so the whole path is capturable in a CUDA graph. No atomics: results are deterministic.
Imported only where CUDA and triton are present (and by the Triton interpreter in checks on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerl.kernels.fused_moe_configs import KernelConfig, max_row_blocks
from moerl.kernels.triton_moe import gather_weighted_sum

_ALIGN_CHUNK = 64  # pairs per alignment program: its [CHUNK, E] one-hot stays in registers
_ALIGN_ROWS = 32  # chunks' counts (and row blocks) handled per loop step of the scatter kernel


@triton.jit(do_not_specialize=["M", "S", "share"])
def _align_count_kernel(idx_ptr, counts_ptr, pair_ptr, M, S, E, share, CHUNK: tl.constexpr, E_POW2: tl.constexpr,
                        FILL: tl.constexpr):
    """counts[c, e] = pairs of chunk c routed to e; this program's `share` rows of pair_S set to the sentinel M."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(idx_ptr + offs, mask=offs < M, other=-1)
    experts = tl.arange(0, E_POW2)
    hit = ((ids[:, None] == experts[None, :]) & (experts[None, :] < E)).to(tl.int32)
    tl.store(counts_ptr + c * E_POW2 + experts, tl.sum(hit, axis=0))
    lo = c * share
    hi = tl.minimum(lo + share, S)
    for start in range(lo, hi, FILL):
        rows = start + tl.arange(0, FILL)
        tl.store(pair_ptr + rows, tl.zeros([FILL], tl.int32) + M, mask=rows < hi)


@triton.jit(do_not_specialize=["M", "B", "num_chunks", "share"])
def _align_scatter_kernel(idx_ptr, counts_ptr, pair_ptr, expert_ptr, num_blocks_ptr, M, B, E, num_chunks, share,
                          BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_POW2: tl.constexpr, ROWS: tl.constexpr):
    """Write chunk c's pair ids at their aligned rows: expert e's rows start at its first block (a prefix sum of
    padded block counts), then the pairs of e in earlier chunks, then the earlier pairs of e in this chunk."""
    c = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    total = tl.zeros([E_POW2], tl.int32)
    before = tl.zeros([E_POW2], tl.int32)
    for c0 in range(0, num_chunks, ROWS):
        chunks = c0 + tl.arange(0, ROWS)
        cnt = tl.load(counts_ptr + chunks[:, None] * E_POW2 + experts[None, :], mask=chunks[:, None] < num_chunks,
                      other=0)
        total += tl.sum(cnt, axis=0)
        before += tl.sum(tl.where(chunks[:, None] < c, cnt, 0), axis=0)
    blocks = (total + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    base = (block_end - blocks) * BLOCK_M + before
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(idx_ptr + offs, mask=offs < M, other=-1)
    hit = ((ids[:, None] == experts[None, :]) & (experts[None, :] < E)).to(tl.int32)
    rank = tl.cumsum(hit, axis=0) - 1  # stable: earlier pairs of the same expert in this chunk
    pos = tl.sum(hit * (base[None, :] + rank), axis=1)
    tl.store(pair_ptr + pos, offs, mask=tl.sum(hit, axis=1) > 0)
    num_valid = tl.sum(blocks, axis=0)
    if c == 0:
        tl.store(num_blocks_ptr, num_valid)
    # expert of each row block: how many experts' blocks end at or before it (this program's share of B)
    lo = c * share
    hi = tl.minimum(lo + share, B)
    for b0 in range(lo, hi, ROWS):
        b = b0 + tl.arange(0, ROWS)
        owner = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ptr + b, tl.where(b < num_valid, owner, -1), mask=b < hi)


def moe_align(topk_idx_TK: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_moe.moe_align_reference in two launches: (pair_S int32, expert_B int32, num_blocks int32 [1])."""
    flat_M = topk_idx_TK.reshape(-1).contiguous()
    M, device = flat_M.numel(), flat_M.device
    B = max_row_blocks(M, num_experts, block_m)
    pair_S = torch.empty(B * block_m, dtype=torch.int32, device=device)
    expert_B = torch.empty(B, dtype=torch.int32, device=device)
    num_blocks = torch.zeros(1, dtype=torch.int32, device=device)
    if M == 0:
        return pair_S, expert_B, num_blocks
    C = triton.cdiv(M, _ALIGN_CHUNK)
    E_POW2 = max(2, triton.next_power_of_2(num_experts))
    counts_CE = torch.empty(C, E_POW2, dtype=torch.int32, device=device)
    # Each of the C programs also fills its share of pair_S with the sentinel and of expert_B with owners.
    _align_count_kernel[(C,)](flat_M, counts_CE, pair_S, M, B * block_m, num_experts, triton.cdiv(B * block_m, C),
                              CHUNK=_ALIGN_CHUNK, E_POW2=E_POW2, FILL=256, num_warps=4)
    _align_scatter_kernel[(C,)](flat_M, counts_CE, pair_S, expert_B, num_blocks, M, B, num_experts, C,
                                triton.cdiv(B, C), BLOCK_M=block_m, CHUNK=_ALIGN_CHUNK, E_POW2=E_POW2,
                                ROWS=_ALIGN_ROWS, num_warps=8)
    return pair_S, expert_B, num_blocks


@triton.jit
def _tile(pid, num_pid_m, num_pid_n, group_m):
    """(row block, column block) of a program: group_m consecutive row blocks (mostly one expert's) walk the
    column blocks together, so each weight tile is read from HBM once and from L2 by the rest of the group."""
    width = group_m * num_pid_n
    first_m = (pid // width) * group_m
    size_m = tl.minimum(num_pid_m - first_m, group_m)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit(do_not_specialize=["M", "num_pid_m", "group_m"])
def _gate_up_swiglu_kernel(x_ptr, w_ptr, h_ptr, pair_ptr, expert_ptr, num_blocks_ptr, M, D, I, num_pid_m, group_m,
                           stride_xt, stride_we, stride_wn, stride_hm, K: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), num_pid_m, tl.cdiv(I, BLOCK_N), group_m)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    pair = tl.load(pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < M  # padding rows hold the sentinel M
    token = (pair // K).to(tl.int64)
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = (offs_n % I).to(tl.int64)  # columns past I wrap onto real weight rows: loaded, never stored
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + expert * stride_we + rows_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + I * stride_wn  # the up projection: rows I..2I-1 of the fused [2I, D] weight
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = offs_k < D - k0
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if IEEE:  # float32 activations: full-precision products, not TF32
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    # Round gate and up to the activation dtype first, as the training path's grouped GEMM output is.
    out_ty = h_ptr.dtype.element_ty
    gate = acc_g.to(out_ty).to(tl.float32)
    up = acc_u.to(out_ty).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(out_ty), mask=row_ok[:, None] & (offs_n[None, :] < I))


@triton.jit(do_not_specialize=["M", "num_pid_m", "group_m"])
def _down_kernel(h_ptr, w_ptr, y_ptr, pair_ptr, expert_ptr, num_blocks_ptr, M, D, I, num_pid_m, group_m,
                 stride_hm, stride_we, stride_wn, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), num_pid_m, tl.cdiv(D, BLOCK_N), group_m)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    pair = tl.load(pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < M
    row = pair.to(tl.int64)  # h and y are in pair order: no permuted copies
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = (offs_n % D).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + row[:, None] * stride_hm + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + rows_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            a = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < I - k0
            a = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + row[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < D))


Aligned = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()  # a copy only for an unusual layout; the kernels need it


def gate_up_swiglu(x_TD: torch.Tensor, gate_up_EFD: torch.Tensor, aligned: Aligned, K: int,
                   cfg: KernelConfig) -> torch.Tensor:
    """h_MI in pair order (kernel 1); `aligned` from moe_align with cfg.block_m."""
    pair_S, expert_B, num_blocks = aligned
    x_TD, gate_up_EFD = _last_dim_contiguous(x_TD), _last_dim_contiguous(gate_up_EFD)
    D, I, B = x_TD.shape[1], gate_up_EFD.shape[1] // 2, expert_B.numel()
    h_MI = torch.empty(x_TD.shape[0] * K, I, dtype=x_TD.dtype, device=x_TD.device)
    grid = (B * triton.cdiv(I, cfg.block_n),)
    _gate_up_swiglu_kernel[grid](x_TD, gate_up_EFD, h_MI, pair_S, expert_B, num_blocks, h_MI.shape[0], D, I, B,
                                 cfg.group_m, x_TD.stride(0), gate_up_EFD.stride(0), gate_up_EFD.stride(1),
                                 h_MI.stride(0), K=K, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                 BLOCK_K=cfg.block_k, EVEN_K=D % cfg.block_k == 0, IEEE=x_TD.dtype == torch.float32,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return h_MI


def down_proj(h_MI: torch.Tensor, down_EDI: torch.Tensor, aligned: Aligned, cfg: KernelConfig) -> torch.Tensor:
    """y_MD in pair order, unweighted (kernel 2); `aligned` from moe_align with cfg.block_m."""
    pair_S, expert_B, num_blocks = aligned
    down_EDI = _last_dim_contiguous(down_EDI)
    M, I = h_MI.shape
    D, B = down_EDI.shape[1], expert_B.numel()
    y_MD = torch.empty(M, D, dtype=h_MI.dtype, device=h_MI.device)
    grid = (B * triton.cdiv(D, cfg.block_n),)
    _down_kernel[grid](h_MI, down_EDI, y_MD, pair_S, expert_B, num_blocks, M, D, I, B, cfg.group_m,
                       h_MI.stride(0), down_EDI.stride(0), down_EDI.stride(1), y_MD.stride(0),
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=I % cfg.block_k == 0,
                       IEEE=h_MI.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y_MD


def fused_moe_triton(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, w_TK: torch.Tensor, gate_up_EFD: torch.Tensor,
                     down_EDI: torch.Tensor, gate_up_cfg: KernelConfig, down_cfg: KernelConfig) -> torch.Tensor:
    """The whole path: align (once when both kernels share BLOCK_M), kernel 1, kernel 2, combine."""
    T, K = topk_idx_TK.shape
    E = down_EDI.shape[0]
    if T == 0:
        return x_TD.new_empty(0, x_TD.shape[1])
    aligned_gu = moe_align(topk_idx_TK, E, gate_up_cfg.block_m)
    aligned_dn = aligned_gu if down_cfg.block_m == gate_up_cfg.block_m else moe_align(topk_idx_TK, E,
                                                                                          down_cfg.block_m)
    h_MI = gate_up_swiglu(x_TD, gate_up_EFD, aligned_gu, K, gate_up_cfg)
    y_MD = down_proj(h_MI, down_EDI, aligned_dn, down_cfg)
    # The training path's combine kernel (same float32 sum over k in order), y already in pair order.
    pairs_TK = torch.arange(T * K, device=x_TD.device).view(T, K)
    return gather_weighted_sum(y_MD, pairs_TK, w_TK)
