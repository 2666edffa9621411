"""RMSNorm and the residual add + RMSNorm: the torch references (HF's numerics, moerl.model.layers.RMSNorm's) and
the dispatch to the fused Triton kernels (moerl/kernels/triton_norm.py; with a backward, triton_norm_train.py).

On CUDA with triton, where no autograd graph is recorded (`torch.is_grad_enabled()` False: the rollout engine's
forwards, under no_grad) the forward-only kernels run; where one is (training) the same forward kernel with a
Triton backward, behind autograd Functions (moerl/kernels/triton_norm_train.py), for rows with a contiguous last
dim. Every CPU run, float64, and the rest take the references, which are the exact torch expressions the model
always used (so those paths are bitwise unchanged). Neither path syncs with the host, so both can be captured
in a CUDA graph (the engine's decode).
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
    """Whether the forward-only Triton kernels take this call: no autograd graph to record (with one,
    `fused_norm_train_applies` decides), CUDA + triton, float dtypes, rows that fit the kernel's registers."""
    if torch.is_grad_enabled() or not use_triton(x) or weight.dtype not in _FLOATS:
        return False
    from moerl.kernels.triton_norm import MAX_D

    return x.shape[-1] <= MAX_D and weight.shape == x.shape[-1:] and weight.device == x.device


def fused_norm_train_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the differentiable Triton norm takes this call: grad enabled (training), CUDA + triton, float
    dtypes, a contiguous last dim, rows the backward holds in registers, plain tensors (no DTensor shard).
    Decided from shapes, dtypes and grad mode only, so a checkpoint's recompute takes the same path."""
    if not torch.is_grad_enabled() or not use_triton(x) or weight.dtype not in _FLOATS:
        return False
    from moerl.kernels.triton_norm_train import MAX_D

    return (x.shape[-1] <= MAX_D and weight.shape == x.shape[-1:] and weight.device == x.device
            and x.stride(-1) == 1 and type(x) is torch.Tensor and type(weight) in (torch.Tensor, torch.nn.Parameter))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape: q_norm/k_norm run it over head_dim)."""
    if fused_norm_applies(x, weight):
        from moerl.kernels.triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    if fused_norm_train_applies(x, weight):
        from moerl.kernels.triton_norm_train import rms_norm_train

        return rms_norm_train(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): the residual stream and its norm, one kernel on CUDA (in training one
    kernel forward and one backward, which also adds the sum's two incoming gradients)."""
    if h.shape == delta.shape and h.dtype == delta.dtype and fused_norm_applies(h, weight):
        from moerl.kernels.triton_norm import add_rms_norm_triton

        return add_rms_norm_triton(h, delta, weight, eps)
    if (h.shape == delta.shape and h.dtype == delta.dtype and delta.stride(-1) == 1 and type(delta) is torch.Tensor
            and fused_norm_train_applies(h, weight)):
        from moerl.kernels.triton_norm_train import add_rms_norm_train

        return add_rms_norm_train(h, delta, weight, eps)
    return add_rms_norm_reference(h, delta, weight, eps)
