"""Dense building blocks of the Qwen3-MoE decoder: RMSNorm, rotary embeddings, attention, SwiGLU MLP.

Shape legend: B batch, T query positions, S key positions, H query heads, G key/value heads,
d head size, D hidden size.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.config import MoEModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, exactly as HF does, so logits agree.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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


class KVCacheLayer(Protocol):
    """What attention needs from a KV cache (the rollout engine provides one)."""

    def update(self, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values and return all keys/values to attend over, [B, G, S, d]."""
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
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BHTd = self.q_norm(self.q_proj(x_BTD).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k_BGTd = self.k_norm(self.k_proj(x_BTD).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v_BGTd = self.v_proj(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q_BHTd, k_BGTd = apply_rotary(q_BHTd, cos, sin), apply_rotary(k_BGTd, cos, sin)
        if kv_cache is not None:
            k_BGTd, v_BGTd = kv_cache.update(k_BGTd, v_BGTd)
        # A mask from the caller (KV cache, padding) replaces the plain causal one.
        out_BHTd = F.scaled_dot_product_attention(
            q_BHTd,
            k_BGTd,
            v_BGTd,
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return self.o_proj(out_BHTd.transpose(1, 2).reshape(B, T, -1))


class DenseMLP(nn.Module):
    """SwiGLU MLP for the layers that are not sparse."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
