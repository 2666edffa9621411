"""Triton sampling kernel: Gumbel-max over the vocabulary in one pass, with the chosen token's log-softmax.

Shape legend: B rows, V vocabulary.

One program per row walks the vocabulary in blocks, each lane keeping its own running state (no reduction
inside the loop): it scales the logits by the row's temperature, keeps an online logsumexp (max and rescaled
sum), draws the row's Gumbel noise from the same 32-bit hash as moerl.rollout.sampling.gumbel_at (here in
uint32 arithmetic: the same bits), and keeps the running argmax of scaled logit + noise; the lanes are reduced
once at the end (first index on ties, like torch.argmax). The logits are read once; nothing of size [B, V] is
written. Temperature 0 rows take the argmax of the logits and the log-prob at temperature 1.
The torch reference is moerl.rollout.sampling.gumbel_argmax_reference; tests/gpu/test_kernels_gpu.py compares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    """moerl.rollout.sampling._mix32 on uint32: wrapping products keep the low 32 bits the int64 path masks."""
    x = (x ^ (x >> 16)) * 0x7FEB352D
    x = (x ^ (x >> 15)) * 0x2C1B3C6D
    x = (x ^ (x >> 16)) * 0x297A2D39
    return x ^ (x >> 15)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_b, temp_ptr, key_ptr, token_ptr, logprob_ptr, V,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(temp_ptr + row)
    greedy = temp == 0.0
    t = tl.where(greedy, 1.0, temp)
    key = tl.load(key_ptr + row).to(tl.uint32)
    base = logits_ptr + row.to(tl.int64) * stride_b
    lanes = tl.arange(0, BLOCK)
    # Per-lane running state (lane j sees tokens j, j + BLOCK, ...); one reduction at the end, none in the loop.
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # max of the scaled logits
    s = tl.zeros([BLOCK], tl.float32)  # sum of exp(scaled - m)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # max of scaled + noise
    best_idx = tl.zeros([BLOCK], tl.int32)
    best_x = tl.zeros([BLOCK], tl.float32)  # the scaled logit of best_idx
    for start in range(0, V, BLOCK):
        offs = start + lanes
        mask = offs < V
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.math.div_rn(x, t)  # IEEE division, as torch's logits / temperature
        new_m = tl.maximum(m, x)
        empty = new_m == float("-inf")  # nothing seen yet in this lane: keep exp() away from -inf - -inf
        d_old = tl.where(empty, 0.0, m - new_m)
        d_new = tl.where(empty, 0.0, x - new_m)
        s = tl.where(empty, 0.0, s * tl.exp(d_old) + tl.exp(d_new))
        m = new_m
        bits = _mix32(key ^ _mix32(offs.to(tl.uint32) * 0x9E3779B1 + 0x632BE5AB))
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # in (0, 1): see sampling.uniform_of
        g = -tl.log(-tl.log(u))
        noisy = tl.where(mask, tl.where(greedy, x, x + g), float("-inf"))
        better = noisy > best  # strictly: a lane keeps its earlier token on a tie
        best = tl.where(better, noisy, best)
        best_idx = tl.where(better, offs, best_idx)
        best_x = tl.where(better, x, best_x)
    m_row = tl.max(m, 0)
    s_row = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_row)), 0)
    top = tl.max(best, 0)
    token = tl.min(tl.where(best == top, best_idx, V), 0)  # the first token at the maximum, as torch.argmax
    x_token = tl.max(tl.where((best == top) & (best_idx == token), best_x, float("-inf")), 0)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, x_token - (m_row + tl.log(s_row)))


def gumbel_argmax_triton(logits_BV: torch.Tensor, temperature_B: torch.Tensor,
                         key_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_B int64, logprob_B float32); key_B: moerl.rollout.sampling.noise_key of (seed, position)."""
    if logits_BV.stride(-1) != 1:
        logits_BV = logits_BV.contiguous()
    B, V = logits_BV.shape
    token_B = torch.empty(B, dtype=torch.int64, device=logits_BV.device)
    logprob_B = torch.empty(B, dtype=torch.float32, device=logits_BV.device)
    _gumbel_argmax_kernel[(B,)](logits_BV, logits_BV.stride(0), temperature_B.float().contiguous(),
                                key_B.contiguous(), token_B, logprob_B, V, BLOCK=1024, num_warps=4)
    return token_B, logprob_B
