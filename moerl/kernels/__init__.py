"""Fused kernels for the memory-bound parts of the MoE step, with torch reference implementations.

Every op here has one torch implementation (any device, any dtype, the reference) and, on CUDA with triton
installed, a Triton one. `use_triton(x)` decides per call; the torch path is what CPU tests exercise, and
scripts/gpu/kernels_check.py checks the Triton path against it on a GPU.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    return _TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up on the fused [N, 2I] projection; the backward writes [N, 2I] directly (no cat)."""

    @staticmethod
    def forward(ctx, h_NF: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h_NF)
        if use_triton(h_NF):
            from moerl.kernels.triton_moe import swiglu_forward

            return swiglu_forward(h_NF)
        gate_NI, up_NI = h_NF.chunk(2, dim=-1)
        return F.silu(gate_NI) * up_NI

    @staticmethod
    def backward(ctx, grad_NI: torch.Tensor) -> torch.Tensor:
        (h_NF,) = ctx.saved_tensors
        if use_triton(h_NF):
            from moerl.kernels.triton_moe import swiglu_backward

            return swiglu_backward(h_NF, grad_NI)
        gate_NI, up_NI = h_NF.float().chunk(2, dim=-1)
        sig_NI = torch.sigmoid(gate_NI)
        grad32_NI = grad_NI.float()
        grad_gate_NI = grad32_NI * up_NI * sig_NI * (1 + gate_NI * (1 - sig_NI))
        grad_up_NI = grad32_NI * gate_NI * sig_NI
        return torch.cat([grad_gate_NI, grad_up_NI], dim=-1).to(h_NF.dtype)


def swiglu(h_NF: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate|up projection [N, 2I] -> [N, I]."""
    return _SwiGLU.apply(h_NF)
