"""The Qwen3-MoE causal language model: parameter names and numerics match transformers' Qwen3MoeForCausalLM.

Shape legend: B batch, T positions, D hidden size, V vocabulary, L MoE layers, K experts per token,
E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moerl.ep.dispatcher import Dispatcher
from moerl.model.checkpointing import CheckpointMode, context_fn
from moerl.model.config import MoEModelConfig
from moerl.model.layers import Attention, DenseMLP, KVCacheLayer, RMSNorm, RotaryEmbedding, varlen_unavailable_reason
from moerl.model.moe import ExpertsImpl, MoEOutput, SparseMoEBlock
from moerl.model.logprobs import chunked_token_logprobs
from moerl.model.packing import PackedSeqs


@dataclass
class CausalLMOutput:
    logits_BTV: torch.Tensor | None  # None with hidden_only
    routed_experts_BTLK: torch.Tensor  # int64, the experts each MoE layer chose (or replayed) per position
    aux_loss: torch.Tensor | None  # mean over MoE layers of the load-balancing loss, when asked for
    expert_counts_LE: torch.Tensor  # int64 tokens per expert per MoE layer (this rank's tokens)
    hidden_BTD: torch.Tensor | None = None  # the final normed hidden states, with hidden_only


@dataclass
class LogProbOutput:
    logprobs_1T: torch.Tensor  # float32 log-prob of each target under the policy (shape of the targets)
    entropy_1T: torch.Tensor | None  # float32 entropy of the policy at each position, when asked for
    routed_experts_BTLK: torch.Tensor
    aux_loss: torch.Tensor | None


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
                replay_TK: torch.Tensor | None, with_aux_loss: bool, packed: PackedSeqs | None = None,
                recompute: CheckpointMode = False) -> tuple[torch.Tensor, MoEOutput | None]:
        """The residual stream after this layer, and the MoE block's output (None for a dense layer).

        A module call (not attribute calls from the model's loop) so per-layer hooks fire: FSDP2 gathers
        a layer's parameters just before it runs and frees them just after.

        recompute: activation checkpointing. The checkpoint sits INSIDE this module's forward, so under
        `fully_shard(layer)` (torchtitan's layout: FSDP2 on the unit, the checkpoint within it) FSDP2's
        pre-backward hook on the layer's output gathers the parameters before the recompute reads them,
        and the recompute calls `_forward`, not the module, so FSDP2's hooks don't fire a second time.
        Non-reentrant `torch.utils.checkpoint` (not `checkpoint_wrapper`, which would rename every parameter
        `_checkpoint_wrapped_module.*` and break the HF names; not composable `checkpoint`, whose hooks
        would stack with FSDP2's on the same module) only intercepts saved tensors, so the dataclass
        output needs no flattening and the aux loss inside it keeps its graph. The recompute routes exactly
        as the forward did: the forward (router top-k included) is bitwise reproducible for the same input,
        CPU and H200 alike (tests/unit/test_packing.py and tests/gpu/test_varlen_gpu.py read it off the
        routers), and a replayed routing is an input. The checkpoint's own check (same count, shapes and
        dtypes of saved tensors) catches a recompute that takes another path."""
        if recompute:  # True: the whole layer; "selective": all but GEMM and attention outputs (checkpointing.py)
            return checkpoint(
                self._forward, h_BTD, rope, cache, attn_mask, replay_TK, with_aux_loss, packed, use_reentrant=False,
                context_fn=context_fn(recompute),
            )
        return self._forward(h_BTD, rope, cache, attn_mask, replay_TK, with_aux_loss, packed)

    def _forward(self, h_BTD: torch.Tensor, rope, cache: KVCacheLayer | None, attn_mask: torch.Tensor | None,
                 replay_TK: torch.Tensor | None, with_aux_loss: bool,
                 packed: PackedSeqs | None) -> tuple[torch.Tensor, MoEOutput | None]:
        # h + attention and its norm: one kernel on the no-grad CUDA path, the same torch ops elsewhere. The
        # attention output is an argument, not a local, so it is freed before the MLP runs (as it was before).
        h_BTD, x_BTD = self.post_attention_layernorm.add_and_norm(
            h_BTD, self.self_attn(self.input_layernorm(h_BTD), rope, cache, attn_mask, packed))
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
        # Recompute each decoder layer in backward (keep only layer inputs) when training without a KV cache.
        self.activation_checkpointing: CheckpointMode = False

    def enable_activation_checkpointing(self, on: CheckpointMode = True) -> None:
        """True: recompute each whole decoder layer in backward; "selective": keep its GEMM and attention outputs
        and recompute the rest (moerl/model/checkpointing.py); False: keep everything."""
        if on not in (False, True, "selective"):
            raise ValueError(f"activation checkpointing must be False, True or 'selective', got {on!r}")
        self.activation_checkpointing = on

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
        packed: PackedSeqs | None = None,
        hidden_only: bool = False,
    ) -> CausalLMOutput:
        """One forward pass.

        routed_experts_BTLK: routing replay; MoE layer l uses experts [:, :, l] instead of its router's top-k.
        kv_caches: one cache per decoder layer (the rollout engine); each attends over its own positions.
        attn_mask: a mask replacing the causal one (without a cache).
        last_logits_only: project only the last position to the vocabulary (logits [B, 1, V]).
        packed: input_ids is one row [1, T] of sequences laid end to end (T = packed.total_len); attention
            stays causal inside each, position ids restart at 0 in each unless given. Flash varlen attention
            on CUDA in bf16/fp16, else causal SDPA on a right-padded [S, P] copy, or SDPA with the
            block-diagonal causal mask (O(T^2) memory) where that is cheaper.
        hidden_only: return the final normed hidden states (hidden_BTD) and no logits, so a caller can
            project to the vocabulary in chunks and never hold [T, V].
        """
        B, T = self._check_input(input_ids_BT, routed_experts_BTLK)
        device = input_ids_BT.device
        if packed is not None:
            self._check_packed(packed, B, T, kv_caches, attn_mask)
            if packed.device != device:
                packed = packed.to(device)
            if position_ids_BT is None:
                position_ids_BT = packed.position_ids()
        if position_ids_BT is None:
            position_ids_BT = torch.arange(T, device=device).expand(B, T)
        h_BTD = self.model.embed_tokens(input_ids_BT)
        rope = self.model.rotary(position_ids_BT, h_BTD.dtype)
        if packed is not None:
            c = self.config
            no_varlen = varlen_unavailable_reason(
                h_BTD.dtype, device, c.num_attention_heads, c.num_key_value_heads, c.head_dim
            )
            # Without the varlen kernel: causal SDPA on a right-padded copy, or the [T, T] block mask where
            # that is cheaper (one sequence much longer than most). Built once here, not per layer: every
            # layer attends over the same boundaries.
            if no_varlen and packed.padding_is_cheaper():
                packed = packed.with_padded_index()
            elif no_varlen:
                attn_mask = packed.causal_block_mask()
        recompute = self.activation_checkpointing if torch.is_grad_enabled() and kv_caches is None else False
        routed, aux_losses, counts = [], [], []
        for i, layer in enumerate(self.model.layers):
            cache = kv_caches[i] if kv_caches is not None else None
            replay_TK = None
            if layer.is_moe and routed_experts_BTLK is not None:
                replay_TK = routed_experts_BTLK[:, :, len(routed)].reshape(B * T, -1)
            h_BTD, moe = layer(h_BTD, rope, cache, attn_mask, replay_TK, with_aux_loss, packed, recompute)
            if moe is not None:
                routed.append(moe.topk_idx_TK.view(B, T, -1))
                counts.append(moe.counts_E)
                if moe.aux_loss is not None:
                    aux_losses.append(moe.aux_loss)
        if last_logits_only:
            h_BTD = h_BTD[:, -1:]
        h_BTD = self.model.norm(h_BTD)
        logits_BTV = None if hidden_only else self.lm_head(h_BTD)
        K = self.config.num_experts_per_tok
        return CausalLMOutput(
            logits_BTV=logits_BTV,
            routed_experts_BTLK=torch.stack(routed, 2) if routed else input_ids_BT.new_zeros(B, T, 0, K),
            aux_loss=torch.stack(aux_losses).mean() if aux_losses else None,
            expert_counts_LE=torch.stack(counts) if counts else input_ids_BT.new_zeros(0, self.config.num_experts),
            hidden_BTD=h_BTD if hidden_only else None,
        )

    def forward_logprobs(self, input_ids_BT: torch.Tensor, target_ids_BT: torch.Tensor, *,
                         packed: PackedSeqs | None = None, with_entropy: bool = False,
                         chunk_tokens: int | None = None, temperature: float = 1.0,
                         **forward_kwargs) -> LogProbOutput:
        """Log-probs of `target_ids_BT` (and the entropy) without ever holding [T, V] logits: the final hidden
        states go through the lm_head in chunks of tokens (moerl/model/logprobs.py), recomputed in backward.

        packed: the sequences laid end to end in a one-row input (see `forward_full`).
        temperature: of the distribution (softmax(logits / temperature)), the rollout's sampling temperature.
        A method of the model, not of its caller, so that under FSDP2 the lm_head is used while the root's
        parameters are gathered (it is registered as an FSDP forward method)."""
        out = self.forward_full(input_ids_BT, packed=packed, hidden_only=True, **forward_kwargs)
        logprobs, entropy = chunked_token_logprobs(out.hidden_BTD, self.lm_head.weight, target_ids_BT,
                                                   with_entropy=with_entropy, chunk_tokens=chunk_tokens,
                                                   temperature=temperature)
        # not views: FSDP2 hooks the root's outputs for backward, and warns on a view (an in-place op would drop it)
        return LogProbOutput(logprobs.clone(), None if entropy is None else entropy.clone(), out.routed_experts_BTLK,
                             out.aux_loss)

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

    @staticmethod
    def _check_packed(packed: PackedSeqs, B: int, T: int, kv_caches, attn_mask: torch.Tensor | None) -> None:
        if B != 1:
            raise ValueError(f"packed input must be one row [1, T], got batch size {B}")
        if T != packed.total_len:
            raise ValueError(
                f"packed input has {T} positions but its cu_seqlens add up to {packed.total_len} "
                f"({packed.num_seqs} sequences)"
            )
        if kv_caches is not None or attn_mask is not None:
            raise ValueError("packed input takes no kv_caches or attn_mask: the sequence boundaries are the mask")

    def enable_expert_bias(self) -> None:
        """Choose experts with the aux-loss-free bias (DeepSeek-V3); see TopKRouter.update_expert_bias."""
        for block in self.moe_blocks:
            block.gate.bias_enabled = True
