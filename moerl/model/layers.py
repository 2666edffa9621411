"""Dense building blocks of the Qwen3-MoE decoder: RMSNorm, rotary embeddings, attention, SwiGLU MLP.

Shape legend: B batch, T query positions, S key positions, H query heads, G key/value heads,
d head size, D hidden size.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moerl.kernels.norm import add_rms_norm, rms_norm
from moerl.model.config import MoEModelConfig
from moerl.model.packing import PackedSeqs, PaddedIndex


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's numerics (float32, cast back before the weight). On CUDA one Triton kernel: forward-only under
        # no_grad, a forward + backward autograd Function in training (q_norm/k_norm too, over head_dim).
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, self(h + delta)): a residual add and this norm, fused into one kernel where `forward` is
        (in training the backward too: one kernel gives the sum's gradient to both h and delta)."""
        return add_rms_norm(h, delta, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_BTf = position_ids_BT[..., None].float() * self.inv_freq.float()
        emb_BTd = torch.cat((freqs_BTf, freqs_BTf), dim=-1)
        return emb_BTd.cos().to(dtype), emb_BTd.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x_BHTd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTd.unsqueeze(1), sin_BTd.unsqueeze(1)
    return x_BHTd * cos + _rotate_half(x_BHTd) * sin


@functools.cache
def _varlen_kernel() -> tuple[Callable[..., torch.Tensor], dict[str, Any], bool] | None:
    """torch's flash varlen attention, the keyword that makes it causal, and whether it takes enable_gqa.

    Imported lazily and inspected: torch 2.10 spells causal `is_causal=True`, later versions
    `window_size=(-1, 0)`; enable_gqa came later still. None where torch has no varlen_attn."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def varlen_unavailable_reason(
    dtype: torch.dtype, device: torch.device | str, num_heads: int, num_kv_heads: int, head_dim: int
) -> str | None:
    """None when packed attention runs the flash varlen kernel, else why it takes the SDPA block mask."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"varlen attention is CUDA-only (device {device})"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"flash varlen attention takes bf16/fp16, not {dtype}"
    if _varlen_kernel() is None:
        return f"torch {torch.__version__} has no usable torch.nn.attention.varlen.varlen_attn"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _varlen_probe(dtype, device, num_heads, num_kv_heads, head_dim)


@functools.cache
def _varlen_probe(dtype: torch.dtype, device: torch.device, H: int, G: int, d: int) -> str | None:
    """Run the kernel forward and backward once on a tiny input of this layout; why it failed, or None.

    Probing up front (not catching the error mid-forward) keeps every forward of a config on one path,
    which activation checkpointing needs: its recompute must save the same tensors as the forward."""
    gen = torch.Generator(device=device).manual_seed(0)
    q_THd = torch.randn(3, H, d, device=device, dtype=dtype, generator=gen, requires_grad=True)
    k_TGd = torch.randn(3, G, d, device=device, dtype=dtype, generator=gen, requires_grad=True)
    v_TGd = torch.randn(3, G, d, device=device, dtype=dtype, generator=gen, requires_grad=True)
    try:
        # Real autograd even when the first packed forward runs under no_grad or inference_mode.
        with torch.inference_mode(False), torch.enable_grad():
            _varlen_attention(q_THd, k_TGd, v_TGd, PackedSeqs.from_lengths([1, 2], device)).sum().backward()
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        # An unsupported GPU, head size or build: the mask path computes the same attention, only slower.
        reason = f"varlen_attn raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(f"packed attention falls back to an SDPA block mask: {reason}", stacklevel=3)
        return reason
    return None


def _varlen_attention(q_THd: torch.Tensor, k_TGd: torch.Tensor, v_TGd: torch.Tensor, packed: PackedSeqs):
    """Causal attention inside each packed sequence with the flash varlen kernel: [T, H, d]."""
    kernel = _varlen_kernel()
    assert kernel is not None
    varlen_attn, causal, takes_gqa = kernel
    gqa = q_THd.shape[1] != k_TGd.shape[1]
    kwargs = dict(causal)
    if gqa and takes_gqa:
        kwargs["enable_gqa"] = True
    elif gqa:  # older torch: give every query head its own copy of its key/value head (SDPA's GQA order)
        rep = q_THd.shape[1] // k_TGd.shape[1]
        k_TGd, v_TGd = k_TGd.repeat_interleave(rep, dim=1), v_TGd.repeat_interleave(rep, dim=1)
    cu_S1 = packed.cu_seqlens_S1
    return varlen_attn(q_THd, k_TGd, v_TGd, cu_S1, cu_S1, packed.max_len, packed.max_len, **kwargs)


def _padded_attention(q_THd: torch.Tensor, k_TGd: torch.Tensor, v_TGd: torch.Tensor, padded: PaddedIndex):
    """Causal attention inside each packed sequence, as causal SDPA on a right-padded [S, P] copy: [T, H, d].

    Where no varlen kernel runs (CPU, float32), this replaces the [T, T] block mask when cheaper
    (`PackedSeqs.padding_is_cheaper`). Real queries never attend to padding (it lies after them), padding
    queries' outputs are dropped, so the result is each sequence's own causal attention."""
    S, P = padded.gather_SP.shape
    idx = padded.gather_SP.reshape(-1)
    q_SHPd, k_SGPd, v_SGPd = (x.index_select(0, idx).view(S, P, *x.shape[1:]).transpose(1, 2)
                              for x in (q_THd, k_TGd, v_TGd))
    out_SHPd = F.scaled_dot_product_attention(q_SHPd, k_SGPd, v_SGPd, is_causal=True,
                                              enable_gqa=q_THd.shape[1] != k_TGd.shape[1])
    return out_SHPd.transpose(1, 2).reshape(S * P, *q_THd.shape[1:]).index_select(0, padded.scatter_T)


class KVCacheLayer(Protocol):
    """What attention needs from a KV cache (the rollout engine provides one)."""

    def attend(self, q_BHTd: torch.Tensor, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor) -> torch.Tensor:
        """Store the new keys/values and return the attention of the queries over every cached position each
        row may see, [B, H, T, d]. The cache attends, not the layer: it knows its layout (a paged cache reads
        each row's own blocks) and which positions each row sees."""
        ...


class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (Qwen3)."""

    def __init__(self, config: MoEModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        D, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(D, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, D, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCacheLayer | None = None,
        attn_mask: torch.Tensor | None = None,
        packed: PackedSeqs | None = None,
    ) -> torch.Tensor:
        """packed: x is [1, T] holding several sequences; attention stays inside each. Without an attn_mask
        it runs the flash varlen kernel (the caller checked `varlen_unavailable_reason`), or causal SDPA on
        a right-padded copy when `packed.padded` is set; with one, that mask must be
        `packed.causal_block_mask()` (built once per forward by the model, not per layer)."""
        B, T, _ = x_BTD.shape
        if packed is not None and attn_mask is None:
            return self.o_proj(self._varlen(x_BTD, rope, packed).reshape(B, T, -1))
        q_BHTd = self.q_norm(self.q_proj(x_BTD).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k_BGTd = self.k_norm(self.k_proj(x_BTD).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v_BGTd = self.v_proj(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q_BHTd, k_BGTd = apply_rotary(q_BHTd, cos, sin), apply_rotary(k_BGTd, cos, sin)
        if kv_cache is not None:
            return self.o_proj(kv_cache.attend(q_BHTd, k_BGTd, v_BGTd).transpose(1, 2).reshape(B, T, -1))
        # A mask from the caller (padding) replaces the plain causal one.
        out_BHTd = F.scaled_dot_product_attention(
            q_BHTd,
            k_BGTd,
            v_BGTd,
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out_BHTd.transpose(1, 2).reshape(B, T, -1))

    def _varlen(
        self, x_1TD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], packed: PackedSeqs
    ) -> torch.Tensor:
        """The packed row in the kernel's [T, heads, d] layout, rotary applied there: no transposes to undo.
        The flash varlen kernel, or with `packed.padded` causal SDPA on the right-padded copy."""
        T = x_1TD.shape[1]
        q_THd = self.q_norm(self.q_proj(x_1TD).view(T, -1, self.head_dim))
        k_TGd = self.k_norm(self.k_proj(x_1TD).view(T, -1, self.head_dim))
        v_TGd = self.v_proj(x_1TD).view(T, -1, self.head_dim)
        cos_T1d, sin_T1d = rope[0][0, :, None], rope[1][0, :, None]
        q_THd = q_THd * cos_T1d + _rotate_half(q_THd) * sin_T1d
        k_TGd = k_TGd * cos_T1d + _rotate_half(k_TGd) * sin_T1d
        if packed.padded is not None:
            return _padded_attention(q_THd, k_TGd, v_TGd, packed.padded)
        return _varlen_attention(q_THd, k_TGd, v_TGd, packed)


class DenseMLP(nn.Module):
    """SwiGLU MLP for the layers that are not sparse."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
