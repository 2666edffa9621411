"""Activation checkpointing policies for a decoder layer: what its backward keeps and what it recomputes.

"full" keeps only each layer's input and re-runs the whole layer's forward in backward: the least memory, and
about a third more compute (every GEMM of the layer twice). "selective" (torch's selective activation
checkpointing) keeps the outputs of the ops that are expensive to redo: the GEMMs (the q/k/v/o projections,
the router, both expert grouped GEMMs) and attention (its output and log-sum-exp), and recomputes the rest in
backward: RMSNorms, rotary, SwiGLU, routing softmax/top-k, permute/combine. Those are cheap in FLOPs but are
most of the kernels, so the recompute costs launches and bandwidth, not tensor-core time. At hidden 1024 and
top-8 the kept tensors are ~40 KB per token per layer (the two expert GEMM outputs are 32 KB of it): choose
the micro-batch size (`train.micro_batch_tokens`) to fit.

torchtitan's "op" SAC keeps the same kind of list (it also skips every other mm to save memory); Megatron's
"selective" recompute keeps everything but attention's core. The ops are matched by name so the list holds
across torch versions that lack some of them (the varlen op is a custom op from torch 2.10 on).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["CheckpointMode", "SAVED_OPS", "context_fn", "selective_context"]

CheckpointMode = Literal[False, True, "selective"]  # False = none, True = full

SAVED_OPS = frozenset({
    "aten.mm", "aten.addmm", "aten.bmm", "aten._grouped_mm",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._flash_attention_forward", "aten._efficient_attention_forward",
    "aten._cudnn_attention_forward", "torch_attn._varlen_attn",
})


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    name = str(getattr(op, "overloadpacket", op))
    return CheckpointPolicy.MUST_SAVE if name in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The (forward, recompute) context pair for `torch.utils.checkpoint.checkpoint(..., context_fn=...)`."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def context_fn(mode: CheckpointMode):
    """checkpoint's context_fn for a mode that checkpoints (True or "selective")."""
    if mode == "selective":
        return selective_context
    from torch.utils.checkpoint import noop_context_fn

    return noop_context_fn

