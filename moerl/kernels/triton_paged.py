"""Paged decode attention in Triton: one query position per row, keys/values read from a block pool.

Shape legend: B rows, H query heads, G key/value heads, N blocks in the pool, P positions per block, d head size,
W blocks per row of the block table.

One program per (row, kv head) handles the H/G query heads that share that kv head (so each key/value is read
once per row), walks the row's positions in tiles of N_TILE keys up to its own length (never the table's full
width: the loop bound is read from `seq_len_B` on the device, so a CUDA graph replays it for any lengths), and
keeps an online softmax in float32 (float64 for float64 inputs). A tile's keys may span several blocks: each key row looks its block up in
the table, so any block size works. Checked against the torch reference (`moerl.kernels.paged_decode_reference`)
by tests/gpu/test_paged_decode_gpu.py; runs on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, seq_len_ptr, out_ptr,
                         stride_qb, stride_qh, stride_kn, stride_kg, stride_kp, stride_tb, stride_ob, stride_oh,
                         scale, P,
                         QG: tl.constexpr, QG_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                         N_TILE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    rows = tl.arange(0, QG_PAD)
    row_ok = rows < QG
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < D
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + (g * QG + rows)[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    seq_len = tl.load(seq_len_ptr + b)
    m_i = tl.full([QG_PAD], float("-inf"), ACC)
    l_i = tl.zeros([QG_PAD], ACC)
    acc = tl.zeros([QG_PAD, D_PAD], ACC)
    keys = tl.arange(0, N_TILE)
    for start in range(0, seq_len, N_TILE):
        pos = start + keys
        key_ok = pos < seq_len
        block = tl.load(table_ptr + b.to(tl.int64) * stride_tb + pos // P, mask=key_ok, other=0).to(tl.int64)
        kv_off = block[:, None] * stride_kn + g * stride_kg + (pos % P)[:, None] * stride_kp + dims[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(ACC) * scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(ACC)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + (g * QG + rows)[:, None] * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_decode(q_BHd: torch.Tensor, k_NGPd: torch.Tensor, v_NGPd: torch.Tensor, table_BW: torch.Tensor,
                 seq_len_B: torch.Tensor, scale: float | None = None, n_tile: int = 64) -> torch.Tensor:
    """softmax(q k^T * scale) v over each row's first seq_len_B[b] positions, in the blocks table_BW[b]: [B, H, d]."""
    B, H, d = q_BHd.shape
    G, P = k_NGPd.shape[1], k_NGPd.shape[2]
    assert k_NGPd.stride(3) == 1 and v_NGPd.stride() == k_NGPd.stride(), "k/v pools: same strides, d contiguous"
    scale = scale if scale is not None else d ** -0.5
    if q_BHd.dtype == torch.float64:  # a Python float reaches the kernel as float32: scale in float64 here
        q_BHd, scale = q_BHd * scale, 1.0
    q_BHd = q_BHd.contiguous() if q_BHd.stride(2) != 1 else q_BHd
    out_BHd = torch.empty_like(q_BHd)
    QG = H // G
    # tf32 is a bf16/fp16 dot's no-op setting; float32 and float64 dots must not round through tf32.
    precision = "ieee" if q_BHd.dtype in (torch.float32, torch.float64) else "tf32"
    _paged_decode_kernel[(B, G)](
        q_BHd, k_NGPd, v_NGPd, table_BW, seq_len_B, out_BHd,
        q_BHd.stride(0), q_BHd.stride(1), k_NGPd.stride(0), k_NGPd.stride(1), k_NGPd.stride(2),
        table_BW.stride(0), out_BHd.stride(0), out_BHd.stride(1),
        scale, P,
        QG=QG, QG_PAD=max(16, triton.next_power_of_2(QG)), D=d, D_PAD=max(16, triton.next_power_of_2(d)),
        N_TILE=n_tile, PRECISION=precision, num_warps=4,
        # float64 inputs keep float64 state (a float64 dot's result would otherwise change the loop's types).
        ACC=tl.float64 if q_BHd.dtype == torch.float64 else tl.float32,
    )
    return out_BHd
