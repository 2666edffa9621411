"""Triton RMSNorm, alone and fused with the residual add before it: one launch where torch takes about eight.

Shape legend: R rows (every leading dim flattened), D the normalised (last) dim.

One program normalises BLOCK_R whole rows held in registers (D <= MAX_D): it reads x (and delta) once, writes the
sum (add_rms_norm) and the normed rows once. The rounding follows the torch expression of
`moerl.kernels.norm.rms_norm_reference` step by step, so outputs are bitwise torch's but for the order of the
sum of squares: the residual add rounds to the activation dtype; squares, their sum and the mean (sum times
torch's factor 1/D, rounded as CUDA's mean kernel computes it), + eps, libdevice's rsqrtf (what torch.rsqrt calls
on CUDA), the product; the cast to the activation dtype; the weight product in float32 (exact for bf16/fp16
operands) rounded once. fp fusion is off so no FMA merges two of these roundings. Checked against the torch
reference by tests/gpu/test_small_kernels_gpu.py; runs on CPU tensors under TRITON_INTERPRET=1. Training's
forward (triton_norm_train.py) is this kernel with STORE_RSTD: it also writes each row's rstd for the backward.
"""

from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MAX_D = 16384  # whole rows in registers; the torch path takes wider ones
# The interpreter has no libdevice: it takes tl.math.rsqrt (numpy's 1/sqrt), enough to check the kernel's logic.
_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _rsqrt(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.rsqrt(x)
    else:
        return tl.math.rsqrt(x)


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, rstd_ptr, R, D, stride_x, stride_delta, mean_factor,
                     eps, HAS_DELTA: tl.constexpr, STORE_RSTD: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_D: tl.constexpr, LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    mask = (rows < R)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + rows[:, None] * stride_delta + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # h + delta, rounded as torch's
        tl.store(sum_ptr + rows[:, None] * D + cols[None, :], x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=1) * mean_factor
    rstd = _rsqrt(mean_sq + eps, LIBDEVICE)
    if STORE_RSTD:  # the training forward: its backward (triton_norm_train.py) reads the scale, not the sums
        tl.store(rstd_ptr + rows, rstd, mask=rows < R)
    y = x32 * rstd[:, None]
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # HF casts back before the weight
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def mean_factor(rows: int, D: int) -> float:
    """CUDA's mean multiplies the sum by float(outputs) / float(numel) (ReduceMomentKernel.cu); a quotient of two
    float32 values taken in float64 and rounded once is the float32 quotient. 1/D exactly for D a power of two."""
    return _f32(_f32(float(rows)) / _f32(float(rows * D)))


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
            rstd_R: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """rstd_R: float32 [rows], where the training forward wants each row's 1/rms (None: not written)."""
    D = x.shape[-1]
    assert D <= MAX_D, f"rows of {D} > MAX_D={MAX_D}: the torch path normalises those"
    x_RD = x.reshape(-1, D)  # a view where the rows allow it (the last position of each row: a strided view)
    x_RD = x_RD if x_RD.stride(-1) == 1 else x_RD.contiguous()
    R = x_RD.shape[0]
    out = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    summed = None
    delta_RD = x_RD
    if delta is not None:
        delta_RD = delta.reshape(-1, D)
        delta_RD = delta_RD if delta_RD.stride(-1) == 1 else delta_RD.contiguous()
        summed = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if R == 0:
        return summed, out
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_R = max(1, min(16, 4096 // BLOCK_D))  # head_dim rows: many per program; hidden rows: one or two
    _rms_norm_kernel[(triton.cdiv(R, BLOCK_R),)](
        x_RD, delta_RD, weight.contiguous(), summed if summed is not None else out, out,
        rstd_R if rstd_R is not None else out, R, D, x_RD.stride(0), delta_RD.stride(0), mean_factor(R, D), eps,
        HAS_DELTA=delta is not None, STORE_RSTD=rstd_R is not None, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D,
        LIBDEVICE=_LIBDEVICE, num_warps=8 if BLOCK_R * BLOCK_D > 4096 else 4, enable_fp_fusion=False)
    return summed, out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape): [..., D] in promote(x, weight)'s dtype."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm_triton(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta)) in one pass; h and delta of one shape and dtype."""
    assert h.shape == delta.shape and h.dtype == delta.dtype, (h.shape, delta.shape, h.dtype, delta.dtype)
    summed, out = _launch(h, delta, weight, eps)
    assert summed is not None
    return summed, out
