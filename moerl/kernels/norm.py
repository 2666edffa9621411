"""RMSNorm and the residual add + RMSNorm: the torch references (HF's numerics, moerl.model.layers.RMSNorm's) and
the dispatch to the fused Triton kernels (moerl/kernels/triton_norm.py).

The kernels run only where no autograd graph is recorded (`torch.is_grad_enabled()` False: the rollout engine's
forwards, under no_grad) on CUDA with triton; training and every CPU run take the references, which are the
exact torch expressions the model always used (so those paths are bitwise unchanged). Neither path syncs with
the host, so both can be captured in a CUDA graph (the engine's decode).
"""

from __future__ import annotations

import torch

from moerl.kernels import use_triton

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32 and cast back before the weight, exactly as HF does, so logits agree."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = h + delta
    return h, rms_norm_reference(h, weight, eps)


def fused_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton kernels take this call: no autograd graph to record (the kernels have no backward),
    CUDA + triton, float dtypes, rows that fit the kernel's registers."""
    if torch.is_grad_enabled() or not use_triton(x) or weight.dtype not in _FLOATS:
        return False
    from moerl.kernels.triton_norm import MAX_D

    return x.shape[-1] <= MAX_D and weight.shape == x.shape[-1:] and weight.device == x.device


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape: q_norm/k_norm run it over head_dim)."""
    if fused_norm_applies(x, weight):
        from moerl.kernels.triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): the residual stream and its norm, one kernel on the no-grad CUDA path."""
    if h.shape == delta.shape and h.dtype == delta.dtype and fused_norm_applies(h, weight):
        from moerl.kernels.triton_norm import add_rms_norm_triton

        return add_rms_norm_triton(h, delta, weight, eps)
    return add_rms_norm_reference(h, delta, weight, eps)
