"""RMSNorm and residual add + RMSNorm for training: Triton forward and backward behind torch.autograd.Functions.

Shape legend: R rows (every leading dim flattened), D the normalised (last) dim, P backward programs.

The torch expression this differentiates (`moerl.kernels.norm.rms_norm_reference`, HF's Qwen3 RMSNorm):

    rstd = rsqrt(mean(x32^2) + eps);  n = x32 * rstd;  y = w * n.to(x.dtype)     (x32 = x.float())

Forward: the no-grad kernel (triton_norm.py), which also writes rstd [R] float32; it saves x (for add+norm the
sum h + delta it wrote), w and rstd, the same tensors on every call, so a checkpoint's recompute matches.
Backward, per row in float32, the steps of torch's autograd graph of that expression:

    g  = (dy * w).to(x.dtype)             the gradient reaching the cast, rounded to x's dtype as autograd does
    dx = rstd * (g - n * mean(g * n))     cast to x's dtype
    dw = sum over rows of dy * n.to(x.dtype)

dw: each of P programs sums its rows into a float32 [P, D] partial and torch sums those (no atomics: a fixed
assignment of rows to programs, so bitwise reproducible). add+norm: the gradient of the sum h + delta is the norm's
dx (rounded to x's dtype) plus the gradient its other users sent back, added in the same kernel, returned to both
h and delta (as torch's add backward does).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from moerl.kernels.triton_norm import _launch

MAX_D = 8192  # whole rows in registers in the backward; the torch path takes wider ones


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dres_ptr, dx_ptr, dw_ptr, R, D, P, stride_x, stride_dy,
                         stride_dres, inv_D, HAS_DRES: tl.constexpr, COMPUTE_DW: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    start = pid * BLOCK_R
    # Row blocks pid, pid + P, ...: a while loop (the CPU interpreter cannot take range() over runtime bounds).
    while start < R:
        rows = start + tl.arange(0, BLOCK_R)
        start += P * BLOCK_R
        row_ok = rows < R
        mask = row_ok[:, None] & col_ok[None, :]
        rows = rows.to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        n = x.to(tl.float32) * rstd[:, None]  # the forward's normalised rows, bitwise
        if COMPUTE_DW:
            dw_acc += dy * n.to(x_ptr.dtype.element_ty).to(tl.float32)
        g = (dy * w[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
        c = tl.sum(g * n, axis=1) * inv_D
        dx = (rstd[:, None] * (g - n * c[:, None])).to(dx_ptr.dtype.element_ty)
        if HAS_DRES:  # the sum's other gradient, added as autograd accumulates the two (in x's dtype)
            dres = tl.load(dres_ptr + rows[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0)
            dx = (dx.to(tl.float32) + dres.to(tl.float32)).to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + rows[:, None] * D + cols[None, :], dx, mask=mask)
    if COMPUTE_DW:
        tl.store(dw_ptr + pid * D + cols, tl.sum(dw_acc, axis=0), mask=col_ok)


@functools.cache
def _programs_per_device(device: torch.device) -> int:
    """How many backward programs to launch (P: the dw partial's rows): 4 per SM on CUDA, each looping over its
    row blocks; a few on the CPU interpreter, so that each loops there too. Untuned: a first choice."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 3


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    t_RD = t.reshape(-1, D)
    return t_RD if t_RD.stride(-1) == 1 else t_RD.contiguous()


def _forward(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    D = x.shape[-1]
    assert D <= MAX_D, f"rows of {D} > MAX_D={MAX_D}: the torch path normalises those"
    rstd_R = torch.empty(x.numel() // max(D, 1), device=x.device, dtype=torch.float32)
    summed, out = _launch(x, delta, weight, eps, rstd_R=rstd_R)
    return summed, out, rstd_R


def _backward(x: torch.Tensor, weight: torch.Tensor, rstd_R: torch.Tensor, dy: torch.Tensor,
              dres: torch.Tensor | None, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx in x's dtype and shape, dw in the weight's dtype or None) for x [..., D] and dy of y's shape."""
    D = x.shape[-1]
    x_RD, dy_RD = _rows(x, D), _rows(dy, D)
    dres_RD = _rows(dres, D) if dres is not None else dy_RD
    R = x_RD.shape[0]
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if R == 0:
        return dx, torch.zeros_like(weight) if need_dw else None
    BLOCK_D = triton.next_power_of_2(D)
    # head_dim 64: 16 rows a step, hidden: one. 4 elements per thread per tile (8 from D 8192): ptxas gives
    # sm_90 32-64 registers, no spills, where 16 a thread took 100-200.
    BLOCK_R = max(1, min(64, 1024 // BLOCK_D))
    num_warps = max(4, min(32, BLOCK_R * BLOCK_D // 128))
    P = min(triton.cdiv(R, BLOCK_R), _programs_per_device(x.device))
    dw_PD = torch.empty((P, D) if need_dw else (1,), device=x.device, dtype=torch.float32)
    _rms_norm_bwd_kernel[(P,)](
        x_RD, weight.contiguous(), rstd_R, dy_RD, dres_RD, dx, dw_PD, R, D, P, x_RD.stride(0), dy_RD.stride(0),
        dres_RD.stride(0), 1.0 / D, HAS_DRES=dres is not None, COMPUTE_DW=need_dw, BLOCK_R=BLOCK_R,
        BLOCK_D=BLOCK_D, num_warps=num_warps)
    return dx, dw_PD.sum(0).to(weight.dtype) if need_dw else None


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _, out, rstd_R = _forward(x, None, weight, eps)
        ctx.save_for_backward(x, weight, rstd_R)
        return out

    @staticmethod
    @once_differentiable  # the backward is a kernel: no graph of its own (double backward raises)
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd_R = ctx.saved_tensors
        dx, dw = _backward(x, weight, rstd_R, dy, None, ctx.needs_input_grad[1])
        return dx, dw, None


class _AddRMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        summed, out, rstd_R = _forward(h, delta, weight, eps)
        assert summed is not None
        ctx.save_for_backward(summed, weight, rstd_R)
        return summed, out

    @staticmethod
    @once_differentiable
    def backward(ctx, dsum: torch.Tensor, dy: torch.Tensor):
        summed, weight, rstd_R = ctx.saved_tensors
        dh, dw = _backward(summed, weight, rstd_R, dy, dsum, ctx.needs_input_grad[2])
        return dh, dh, dw, None


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape), differentiable: [..., D] in promote(x, weight)'s dtype."""
    return _RMSNormFn.apply(x, weight, eps)


def add_rms_norm_train(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta)), differentiable, one kernel each way; h and delta of one shape and dtype."""
    assert h.shape == delta.shape and h.dtype == delta.dtype, (h.shape, delta.shape, h.dtype, delta.dtype)
    return _AddRMSNormFn.apply(h, delta, weight, eps)
