"""Triton router top-k: softmax over the experts and K rounds of argmax in registers, no sort.

Shape legend: T tokens, E experts (E <= MAX_EXPERTS), K experts per token.

One program takes BLOCK_T whole rows of logits [BLOCK_T, E] into registers, softmaxes each in float32 as torch's
warp softmax does (exp(x - max) with libdevice's expf, the sum, an IEEE division), then picks K times the largest
score (probs, or probs + expert_bias: the bias chooses, the weights stay the probs) and masks it out, so the
experts come in descending score order like torch.topk. Ties go to the lowest expert index (torch.topk leaves
their order unspecified; exact ties need equal float32 scores). norm_topk_prob divides the K weights by their
float32 sum (IEEE). Indices are int64, weights in the logits' dtype, as moerl.model.moe.TopKRouter returns them.
Checked against `moerl.kernels.router.router_topk_reference` by tests/gpu/test_small_kernels_gpu.py; runs on CPU
tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MAX_EXPERTS = 256  # a row in registers; the torch path takes more
_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"  # the interpreter has no libdevice: numpy's exp there


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)  # torch's std::exp; tl.exp is the faster, less exact ex2.approx
    else:
        return tl.exp(x)


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, T, E, stride_t,
                        K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, LIBDEVICE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))  # padding experts: probability 0, never chosen
    e = _exp(x - tl.max(x, axis=1)[:, None], LIBDEVICE)
    p = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])
    score = p
    if HAS_BIAS:
        score = p + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    score = tl.where(col_ok[None, :], score, float("-inf"))
    slots = tl.arange(0, K_PAD)
    idx_TK = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    w_TK = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    for k in tl.static_range(K):
        best = tl.max(score, axis=1)
        # the lowest index holding the max; E - 1 where none equals it (a NaN row), so the index stays in range
        pick = tl.minimum(tl.min(tl.where(score == best[:, None], cols[None, :], BLOCK_E), axis=1), E - 1)
        chosen = cols[None, :] == pick[:, None]
        idx_TK = tl.where(slots[None, :] == k, pick[:, None], idx_TK)
        w_TK = tl.where(slots[None, :] == k, tl.sum(tl.where(chosen, p, 0.0), axis=1)[:, None], w_TK)
        score = tl.where(chosen, float("-inf"), score)
    if NORM:
        w_TK = tl.math.div_rn(w_TK, tl.sum(w_TK, axis=1)[:, None])  # padding slots hold 0: not in the sum
    out = rows[:, None] * K + slots[None, :]
    out_mask = row_ok[:, None] & (slots < K)[None, :]
    tl.store(idx_ptr + out, idx_TK.to(tl.int64), mask=out_mask)
    tl.store(w_ptr + out, w_TK.to(w_ptr.dtype.element_ty), mask=out_mask)


def router_topk_triton(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool,
                       expert_bias_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx_TK int64, topk_weights_TK in the logits' dtype): TopKRouter's routing without replay."""
    T, E = logits_TE.shape
    assert E <= MAX_EXPERTS and 0 < top_k <= E, (E, top_k)
    idx_TK = torch.empty(T, top_k, device=logits_TE.device, dtype=torch.int64)
    w_TK = torch.empty(T, top_k, device=logits_TE.device, dtype=logits_TE.dtype)
    if T == 0:
        return idx_TK, w_TK
    logits_TE = logits_TE if logits_TE.stride(1) == 1 else logits_TE.contiguous()
    BLOCK_E = max(16, triton.next_power_of_2(E))
    BLOCK_T = max(1, 512 // BLOCK_E)  # several rows per program: E=128 -> 4 rows, 64 programs at decode's 256
    # The K rounds are a chain of row reductions: within one warp each is register shuffles, with no
    # shared-memory round trip and barrier between warps.
    bias_E = expert_bias_E.contiguous() if expert_bias_E is not None else logits_TE
    _router_topk_kernel[(triton.cdiv(T, BLOCK_T),)](
        logits_TE, bias_E, idx_TK, w_TK, T, E, logits_TE.stride(0),
        K=top_k, K_PAD=triton.next_power_of_2(top_k), NORM=norm_topk_prob, HAS_BIAS=expert_bias_E is not None,
        BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, LIBDEVICE=_LIBDEVICE, num_warps=1, enable_fp_fusion=False)
    return idx_TK, w_TK
