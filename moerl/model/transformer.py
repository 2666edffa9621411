"""The Qwen3-MoE causal language model: parameter names and numerics match transformers' Qwen3MoeForCausalLM.

Shape legend: B batch, T positions, D hidden size, V vocabulary, L MoE layers, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from moerl.ep.dispatcher import Dispatcher
from moerl.model.config import MoEModelConfig
from moerl.model.layers import Attention, DenseMLP, KVCacheLayer, RMSNorm, RotaryEmbedding
from moerl.model.moe import ExpertsImpl, MoEOutput, SparseMoEBlock


@dataclass
class CausalLMOutput:
    logits_BTV: torch.Tensor
    routed_experts_BTLK: torch.Tensor  # int64, the experts each MoE layer chose (or replayed) per position
    aux_loss: torch.Tensor | None  # mean over MoE layers of the load-balancing loss, when asked for
    expert_counts_LE: torch.Tensor  # int64 tokens per expert per MoE layer (this rank's tokens)


class DecoderLayer(nn.Module):
    def __init__(self, config: MoEModelConfig, layer_idx: int, moe_kwargs: dict) -> None:
        super().__init__()
        self.is_moe = config.is_moe_layer(layer_idx)
        self.self_attn = Attention(config)
        self.mlp: nn.Module = (
            SparseMoEBlock(config, **moe_kwargs)
            if self.is_moe
            else DenseMLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h_BTD: torch.Tensor, rope, cache: KVCacheLayer | None, attn_mask: torch.Tensor | None,
                replay_TK: torch.Tensor | None, with_aux_loss: bool) -> tuple[torch.Tensor, MoEOutput | None]:
        """The residual stream after this layer, and the MoE block's output (None for a dense layer).

        A module call (not attribute calls from the model's loop) so per-layer hooks fire: FSDP2 gathers
        a layer's parameters just before it runs and frees them just after."""
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), rope, cache, attn_mask)
        x_BTD = self.post_attention_layernorm(h_BTD)
        if not self.is_moe:
            return h_BTD + self.mlp(x_BTD), None
        B, T, _ = x_BTD.shape
        moe = self.mlp(x_BTD.reshape(B * T, -1), replay_TK, with_aux_loss)
        return h_BTD + moe.out_TD.view_as(h_BTD), moe


class DecoderBody(nn.Module):
    """`model.*` in HF's names: embeddings, decoder layers, final norm."""

    def __init__(self, config: MoEModelConfig, moe_kwargs: dict) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, moe_kwargs) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)


class MoECausalLM(nn.Module):
    def __init__(
        self,
        config: MoEModelConfig,
        *,
        dispatcher: Dispatcher | None = None,
        capacity_factor: float = 0.0,
        experts_impl: ExpertsImpl = "auto",
    ) -> None:
        super().__init__()
        config.validate()
        self.config = config
        moe_kwargs = dict(dispatcher=dispatcher, capacity_factor=capacity_factor, experts_impl=experts_impl)
        self.model = DecoderBody(config, moe_kwargs)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.num_moe_layers = len(config.moe_layer_indices)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def moe_blocks(self) -> list[SparseMoEBlock]:
        return [layer.mlp for layer in self.model.layers if layer.is_moe]

    def forward(self, input_ids_BT: torch.Tensor, **kwargs) -> torch.Tensor:
        """Logits [B, T, V]. `forward_full` returns routing and balancing statistics too."""
        return self.forward_full(input_ids_BT, **kwargs).logits_BTV

    def forward_full(
        self,
        input_ids_BT: torch.Tensor,
        *,
        position_ids_BT: torch.Tensor | None = None,
        routed_experts_BTLK: torch.Tensor | None = None,
        with_aux_loss: bool = False,
        kv_caches: Sequence[KVCacheLayer] | None = None,
        attn_mask: torch.Tensor | None = None,
        last_logits_only: bool = False,
    ) -> CausalLMOutput:
        """One forward pass.

        routed_experts_BTLK: routing replay; MoE layer l uses experts [:, :, l] instead of its router's top-k.
        kv_caches / attn_mask: one cache per decoder layer and the matching mask (the rollout engine).
        last_logits_only: project only the last position to the vocabulary (logits [B, 1, V]).
        """
        B, T = self._check_input(input_ids_BT, routed_experts_BTLK)
        if position_ids_BT is None:
            position_ids_BT = torch.arange(T, device=input_ids_BT.device).expand(B, T)
        h_BTD = self.model.embed_tokens(input_ids_BT)
        rope = self.model.rotary(position_ids_BT, h_BTD.dtype)
        routed, aux_losses, counts = [], [], []
        for i, layer in enumerate(self.model.layers):
            cache = kv_caches[i] if kv_caches is not None else None
            replay_TK = None
            if layer.is_moe and routed_experts_BTLK is not None:
                replay_TK = routed_experts_BTLK[:, :, len(routed)].reshape(B * T, -1)
            h_BTD, moe = layer(h_BTD, rope, cache, attn_mask, replay_TK, with_aux_loss)
            if moe is not None:
                routed.append(moe.topk_idx_TK.view(B, T, -1))
                counts.append(moe.counts_E)
                if moe.aux_loss is not None:
                    aux_losses.append(moe.aux_loss)
        if last_logits_only:
            h_BTD = h_BTD[:, -1:]
        logits_BTV = self.lm_head(self.model.norm(h_BTD))
        K = self.config.num_experts_per_tok
        return CausalLMOutput(
            logits_BTV=logits_BTV,
            routed_experts_BTLK=torch.stack(routed, 2) if routed else input_ids_BT.new_zeros(B, T, 0, K),
            aux_loss=torch.stack(aux_losses).mean() if aux_losses else None,
            expert_counts_LE=torch.stack(counts) if counts else input_ids_BT.new_zeros(0, self.config.num_experts),
        )

    def _check_input(self, input_ids_BT: torch.Tensor, routed_BTLK: torch.Tensor | None) -> tuple[int, int]:
        if input_ids_BT.dim() != 2 or input_ids_BT.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"input_ids must be an integer tensor [batch, seq], got {input_ids_BT.dtype} {tuple(input_ids_BT.shape)}"
            )
        B, T = input_ids_BT.shape
        expected = (B, T, self.num_moe_layers, self.config.num_experts_per_tok)
        if routed_BTLK is not None and tuple(routed_BTLK.shape) != expected:
            raise ValueError(
                f"routed_experts must have shape [batch, seq, moe_layers, top_k] = {list(expected)}, "
                f"got {list(routed_BTLK.shape)}"
            )
        return B, T

    def enable_expert_bias(self) -> None:
        """Choose experts with the aux-loss-free bias (DeepSeek-V3); see TopKRouter.update_expert_bias."""
        for block in self.moe_blocks:
            block.gate.bias_enabled = True
