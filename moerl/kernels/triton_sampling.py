"""Triton sampling kernel: Gumbel-max over the vocabulary in one pass, with the chosen token's log-softmax.

Shape legend: B rows, V vocabulary.

One program per row walks the vocabulary in blocks: it scales the logits by the row's temperature, keeps an
online logsumexp (max and rescaled sum), draws the row's Gumbel noise from the same 32-bit hash as
moerl.rollout.sampling.gumbel_at (here in uint32 arithmetic: the same bits), and keeps the running argmax of
scaled logit + noise (first index on ties, like torch.argmax). The logits are read once; nothing of size
[B, V] is written. Temperature 0 rows take the argmax of the logits and the log-prob at temperature 1.
The torch reference is moerl.rollout.sampling.gumbel_argmax_reference; scripts/gpu/kernels_check.py compares.
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
    m = tl.full([], float("-inf"), tl.float32)  # running max of the scaled logits
    s = tl.zeros([], tl.float32)  # running sum of exp(scaled - m)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int32)
    best_x = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.math.div_rn(x, t)  # IEEE division, as torch's logits / temperature
        block_max = tl.max(x, 0)
        new_m = tl.maximum(m, block_max)
        s = s * tl.exp(m - new_m) + tl.sum(tl.where(mask, tl.exp(x - new_m), 0.0), 0)
        m = new_m
        bits = _mix32(key ^ _mix32(offs.to(tl.uint32) * 0x9E3779B1 + 0x632BE5AB))
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        g = -tl.log(-tl.log(u))
        noisy = tl.where(mask, tl.where(greedy, x, x + g), float("-inf"))
        block_best = tl.max(noisy, 0)
        block_idx = tl.argmax(noisy, 0, tie_break_left=True)
        block_x = tl.sum(tl.where(offs == start + block_idx, x, 0.0), 0)
        better = block_best > best  # strictly: the earlier block keeps a tie
        best = tl.where(better, block_best, best)
        best_idx = tl.where(better, start + block_idx, best_idx)
        best_x = tl.where(better, block_x, best_x)
    tl.store(token_ptr + row, best_idx.to(tl.int64))
    tl.store(logprob_ptr + row, best_x - (m + tl.log(s)))


def gumbel_argmax_triton(logits_BV: torch.Tensor, temperature_B: torch.Tensor,
                         key_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_B int64, logprob_B float32); key_B: moerl.rollout.sampling.noise_key of (seed, position)."""
    if logits_BV.stride(-1) != 1:
        logits_BV = logits_BV.contiguous()
    B, V = logits_BV.shape
    token_B = torch.empty(B, dtype=torch.int64, device=logits_BV.device)
    logprob_B = torch.empty(B, dtype=torch.float32, device=logits_BV.device)
    _gumbel_argmax_kernel[(B,)](logits_BV, logits_BV.stride(0), temperature_B.float().contiguous(),
                                key_B.contiguous(), token_B, logprob_B, V, BLOCK=2048, num_warps=8)
    return token_B, logprob_B
