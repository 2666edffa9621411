"""Triton kernels for the chunked token log-probs (moerl/model/logprobs.py): one pass over a chunk's logits in
forward, one in backward, where the torch path runs about ten elementwise and reduction passes over C x V in fp32.

Shape legend: C rows (tokens of one chunk), V vocabulary.

Both kernels read the lm_head GEMM's output [C, V] (bf16, fp16 or fp32; the GEMM stays cuBLAS) one row per
program, in tiles of BLOCK_V, with all arithmetic in fp32:

- `logprob_stats`: an online max / sum over the tiles. With m the running max of l and y = (l - m) / tau, it keeps
  S = sum e^y and T = sum e^y y (<= 0); a new max m' rescales them by a = e^-d, d = (m' - m) / tau >= 0:
  S' = a S, T' = a (T - d S), a sum of terms <= 0 (no cancellation). Then logp = (l_t - m) / tau - log S,
  lse = m / tau + log S and H = log S - T / S: the torch path's expressions, with its final-max shift replaced by
  the running one (the same values but for fp32 rounding).
- `logprob_grad_`: log p = (l - tau lse) / tau, p = e^(log p), grad_l = -e/tau p (log p + H) - g/tau (p - onehot(t))
  (the upstream scalars arrive already scaled by -1/tau; either may be absent), written over the logits in their
  dtype: the buffer the GEMMs for grad_hidden and grad_weight then read.

On a GPU exp, log and the division by tau are libdevice's expf, logf and a round-to-nearest division, the
functions torch's CUDA kernels call, and the gradient's operations come in the torch path's order, so its grad_l
mostly agrees bitwise. Runs on CPU tensors under TRITON_INTERPRET=1 (numpy's exp and log there), which is how the
CPU checks it (tests/gpu/test_logprobs_triton_gpu.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# A row's tile: 8 values per thread at 8 warps (one 16-byte load of bf16). The stats kernel holds 64 registers
# per thread at sm_90 there (4 programs per SM), 109 at 4096 (ptxas -v).
BLOCK_V = 2048
NUM_WARPS = 8
_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"  # the interpreter has no libdevice


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _div(x, y, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.div_rn(x, y)
    else:
        return x / y


@triton.jit
def _to(x, dtype: tl.constexpr, LIBDEVICE: tl.constexpr):
    """fp32 x in dtype, rounded to nearest even. The interpreter truncates fp32 -> bf16: it gets the bits rounded
    first, so that the CPU check sees the GPU's rounding."""
    if not LIBDEVICE:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


# V is a constexpr in both kernels (one compile per vocabulary, and a model has one): the interpreter's loops need
# constant bounds.
@triton.jit
def _stats_kernel(logits_ptr, target_ptr, logp_ptr, lse_ptr, ent_ptr, stride_row, tau, V: tl.constexpr,
                  WITH_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")  # the running max of l (tau > 0: that of l / tau too)
    s = 0.0
    t = 0.0
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        l = tl.load(base + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(l, axis=0))  # finite: every tile holds a column
        y = _div(l - m_new, tau, LIBDEVICE)  # <= 0; -inf off the row, where e = 0
        e = _exp(y, LIBDEVICE)
        d = _div(m_new - m, tau, LIBDEVICE)  # >= 0; inf on the first tile, where s = t = 0 and a = 0
        a = _exp(-d, LIBDEVICE)
        if WITH_ENTROPY:  # (the where()s keep inf * 0 out)
            t = a * (t - tl.where(s > 0, d, 0.0) * s) + tl.sum(e * tl.where(mask, y, 0.0), axis=0)
        s = s * a + tl.sum(e, axis=0)
        m = m_new
    log_s = _log(s, LIBDEVICE)
    l_t = tl.load(base + tl.load(target_ptr + row)).to(tl.float32)
    tl.store(logp_ptr + row, _div(l_t - m, tau, LIBDEVICE) - log_s)
    tl.store(lse_ptr + row, _div(m, tau, LIBDEVICE) + log_s)
    if WITH_ENTROPY:
        tl.store(ent_ptr + row, log_s - _div(t, s, LIBDEVICE))


@triton.jit
def _grad_kernel(logits_ptr, target_ptr, shift_ptr, ent_ptr, neg_g_ptr, neg_e_ptr, stride_row, tau,
                 V: tl.constexpr, HAS_G: tl.constexpr, HAS_E: tl.constexpr, BLOCK_V: tl.constexpr,
                 LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    shift = tl.load(shift_ptr + row)  # tau lse: (l - tau lse) / tau = log p
    target = tl.load(target_ptr + row)
    neg_g = tl.load(neg_g_ptr + row) if HAS_G else 0.0
    neg_e = tl.load(neg_e_ptr + row) if HAS_E else 0.0
    h = tl.load(ent_ptr + row) if HAS_E else 0.0
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        l = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32)
        logp = _div(l - shift, tau, LIBDEVICE)
        p = _exp(logp, LIBDEVICE)
        p_minus_onehot = tl.where(start + cols == target, p - 1.0, p)
        if HAS_E:
            grad = (logp + h) * p * neg_e  # -e/tau p (log p + H)
            if HAS_G:
                grad = grad + p_minus_onehot * neg_g
        else:
            grad = p_minus_onehot * neg_g
        tl.store(base + start + cols, _to(grad, logits_ptr.dtype.element_ty, LIBDEVICE), mask=mask)


def _rows(logits_CV: torch.Tensor) -> int:
    assert logits_CV.dim() == 2 and logits_CV.stride(1) == 1, (logits_CV.shape, logits_CV.stride())
    return logits_CV.shape[0]


def logprob_stats(logits_CV: torch.Tensor, target_C: torch.Tensor, temperature: float, logp_C: torch.Tensor,
                  lse_C: torch.Tensor, entropy_C: torch.Tensor | None, block_v: int | None = None) -> None:
    """Writes logp of the targets, lse of logits / tau and (when entropy_C is given) the entropy, fp32 [C] each.
    The targets must lie in [0, V)."""
    C = _rows(logits_CV)
    if C == 0:
        return
    _stats_kernel[(C,)](logits_CV, target_C, logp_C, lse_C, entropy_C if entropy_C is not None else lse_C,
                        logits_CV.stride(0), float(temperature), V=logits_CV.shape[1],
                        WITH_ENTROPY=entropy_C is not None, BLOCK_V=block_v or BLOCK_V, LIBDEVICE=_LIBDEVICE,
                        num_warps=NUM_WARPS)


def logprob_grad_(logits_CV: torch.Tensor, target_C: torch.Tensor, shift_C: torch.Tensor, temperature: float,
                  entropy_C: torch.Tensor | None, neg_g_C: torch.Tensor | None, neg_e_C: torch.Tensor | None,
                  block_v: int | None = None) -> torch.Tensor:
    """Overwrites logits_CV with grad_l (its dtype) and returns it. shift_C = tau lse; neg_g_C = -g/tau and
    neg_e_C = -e/tau the upstream grads of logp and of the entropy (fp32 [C], one may be None; entropy_C with
    neg_e_C)."""
    C = _rows(logits_CV)
    assert neg_g_C is not None or neg_e_C is not None
    assert neg_e_C is None or entropy_C is not None
    if C == 0:
        return logits_CV
    _grad_kernel[(C,)](logits_CV, target_C, shift_C, entropy_C if neg_e_C is not None else shift_C,
                       neg_g_C if neg_g_C is not None else shift_C, neg_e_C if neg_e_C is not None else shift_C,
                       logits_CV.stride(0), float(temperature), V=logits_CV.shape[1], HAS_G=neg_g_C is not None,
                       HAS_E=neg_e_C is not None, BLOCK_V=block_v or BLOCK_V, LIBDEVICE=_LIBDEVICE,
                       num_warps=NUM_WARPS)
    return logits_CV
