"""Triton kernels for the memory-bound parts of an MoE step on CUDA (the GEMMs stay in torch._grouped_mm).

Shape legend: T tokens, K slots per token, N expert rows (kept pairs, sorted by expert), D hidden, I expert
intermediate. `inverse_TK[t, k]` is the row of pair (t, k) in the expert-sorted order, or -1 if dropped;
`pair_N[n]` is the pair (t*K + k) of row n.

Each kernel reads its inputs once and writes its output once, accumulating in float32 in a fixed order,
so results are deterministic. Checked against the torch reference by tests/gpu/test_kernels_gpu.py.
Imported only where CUDA and triton are present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_weighted_sum_kernel(y_ptr, inv_ptr, w_ptr, out_ptr, D, K: tl.constexpr, HAS_W: tl.constexpr,
                                BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        row = tl.load(inv_ptr + t * K + k)
        y = tl.load(y_ptr + row.to(tl.int64) * D + cols, mask=mask & (row >= 0), other=0.0).to(tl.float32)
        if HAS_W:
            y = y * tl.load(w_ptr + t * K + k).to(tl.float32)
        acc += y
    tl.store(out_ptr + t.to(tl.int64) * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gather_weighted_sum(y_ND: torch.Tensor, inverse_TK: torch.Tensor, w_TK: torch.Tensor | None) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[inverse[t, k]] (w = 1 when None; dropped pairs skipped)."""
    T, K = inverse_TK.shape
    D = y_ND.shape[1]
    out_TD = torch.empty(T, D, device=y_ND.device, dtype=y_ND.dtype)
    if T == 0:
        return out_TD
    BLOCK_D = min(1024, triton.next_power_of_2(D))
    grid = (T, triton.cdiv(D, BLOCK_D))
    _gather_weighted_sum_kernel[grid](y_ND.contiguous(), inverse_TK.contiguous(),
                                      w_TK.contiguous() if w_TK is not None else inverse_TK,
                                      out_TD, D, K=K, HAS_W=w_TK is not None, BLOCK_D=BLOCK_D)
    return out_TD


@triton.jit
def _combine_backward_kernel(grad_ptr, y_ptr, pair_ptr, w_ptr, grad_y_ptr, grad_w_ptr, D,
                             K: tl.constexpr, NEED_GRAD_W: tl.constexpr, BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    pair = tl.load(pair_ptr + n)
    t = pair // K
    w = tl.load(w_ptr + pair).to(tl.float32)
    dot = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        mask = cols < D
        g = tl.load(grad_ptr + t.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_y_ptr + n.to(tl.int64) * D + cols, (g * w).to(grad_y_ptr.dtype.element_ty), mask=mask)
        if NEED_GRAD_W:
            y = tl.load(y_ptr + n.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)
            dot += g * y
    if NEED_GRAD_W:
        tl.store(grad_w_ptr + pair, tl.sum(dot, axis=0))


def combine_backward(grad_TD: torch.Tensor, y_ND: torch.Tensor, pair_N: torch.Tensor, w_TK: torch.Tensor,
                     need_grad_w: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """grad_y[n] = w[pair_n] * grad[token of pair_n]; grad_w[pair_n] = <grad[token], y[n]> (0 if dropped)."""
    N, D = y_ND.shape
    K = w_TK.shape[1]
    grad_y_ND = torch.empty_like(y_ND)
    grad_w_TK = torch.zeros(w_TK.shape, device=w_TK.device, dtype=torch.float32) if need_grad_w else None
    if N:
        BLOCK_D = min(1024, triton.next_power_of_2(D))
        _combine_backward_kernel[(N,)](grad_TD.contiguous(), y_ND.contiguous(), pair_N.contiguous(),
                                       w_TK.contiguous(), grad_y_ND, grad_w_TK if need_grad_w else grad_y_ND,
                                       D, K=K, NEED_GRAD_W=need_grad_w, BLOCK_D=BLOCK_D)
    return grad_y_ND, grad_w_TK.to(w_TK.dtype) if need_grad_w else None


@triton.jit
def _swiglu_forward_kernel(h_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(h_ptr + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(h_ptr, grad_ptr, grad_h_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(h_ptr + row * 2 * I + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * 2 * I + I + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(grad_ptr + row * I + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    grad_g = d * u * s * (1.0 + g * (1.0 - s))
    grad_u = d * g * s
    tl.store(grad_h_ptr + row * 2 * I + cols, grad_g.to(grad_h_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_h_ptr + row * 2 * I + I + cols, grad_u.to(grad_h_ptr.dtype.element_ty), mask=mask)


def _swiglu_grid(N: int, I: int) -> tuple[tuple[int, int], int]:
    BLOCK = min(1024, triton.next_power_of_2(I))
    return (N, triton.cdiv(I, BLOCK)), BLOCK


def swiglu_forward(h_NF: torch.Tensor) -> torch.Tensor:
    N, F = h_NF.shape
    out = torch.empty(N, F // 2, device=h_NF.device, dtype=h_NF.dtype)
    if N:
        grid, BLOCK = _swiglu_grid(N, F // 2)
        _swiglu_forward_kernel[grid](h_NF.contiguous(), out, F // 2, BLOCK=BLOCK)
    return out


def swiglu_backward(h_NF: torch.Tensor, grad_NI: torch.Tensor) -> torch.Tensor:
    N, F = h_NF.shape
    grad_h = torch.empty_like(h_NF)
    if N:
        grid, BLOCK = _swiglu_grid(N, F // 2)
        _swiglu_backward_kernel[grid](h_NF.contiguous(), grad_NI.contiguous(), grad_h, F // 2, BLOCK=BLOCK)
    return grad_h
