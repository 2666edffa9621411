"""How many KV blocks a rollout engine gets: its memory plan, stated before the weights are loaded.

On CUDA the engine may use `gpu_memory_fraction` of the GPU's total memory (and never more than what other
processes leave it): the weights and an activation reserve come first, the KV cache gets the rest in whole
blocks, up to what max_batch_size requests of max_seq_len can use. Where `kv_cache_tokens` is set, the cache
holds that many tokens; on CPU that defaults to max_batch_size requests of max_seq_len (and the one block of
headroom that admission asks for), so every admitted request fits and the engine never waits for blocks, as
with the slab cache before.

The plan refuses, in one line that names the setting to change, weights that do not fit and a cache that
cannot hold one request of max_seq_len.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.model.config import MoEModelConfig

GB = 1e9


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


class MemoryPlanError(ValueError):
    """The engine cannot start with these settings on this device (the message names the setting)."""


@dataclass
class MemoryPlan:
    device: str
    weight_bytes: int
    reserve_bytes: int  # activations, sampling buffers, CUDA context and workspaces (0 on CPU)
    kv_bytes_per_token: int  # keys + values of every layer
    routing_bytes_per_token: int  # host-side routing table (experts per MoE layer)
    block_size: int
    num_blocks: int  # usable blocks (the null block not counted)
    max_seq_len: int
    max_batch_size: int
    budget_bytes: int = 0  # CUDA: what the engine may use in all

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.tokens * self.kv_bytes_per_token

    @property
    def max_full_requests(self) -> int:
        """Requests of max_seq_len tokens that fit at once."""
        return self.num_blocks // -(-self.max_seq_len // self.block_size)

    def describe(self) -> str:
        budget = f" of a {_size(self.budget_bytes)} budget" if self.budget_bytes else ""
        return (f"memory plan ({self.device}): weights {_size(self.weight_bytes)}, KV cache {_size(self.kv_bytes)} = "
                f"{self.num_blocks} blocks x {self.block_size} = {self.tokens} tokens "
                f"({_size(self.kv_bytes_per_token)}/token), reserve {_size(self.reserve_bytes)}{budget}; "
                f"{self.max_full_requests} requests of max_seq_len={self.max_seq_len} at once "
                f"(max_batch_size={self.max_batch_size}); routing table on the host "
                f"{_size(self.tokens * self.routing_bytes_per_token)}")


def kv_bytes_per_token(arch: MoEModelConfig, dtype: torch.dtype) -> int:
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * dtype.itemsize


def weight_bytes(arch: MoEModelConfig, dtype: torch.dtype) -> int:
    """The weights' size, from a model built on the meta device (no memory, no init)."""
    from moerl.model.transformer import MoECausalLM

    with torch.device("meta"):
        model = MoECausalLM(arch)
    seen: set[int] = set()  # tied embeddings count once
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * dtype.itemsize
    return total


def activation_reserve(arch: MoEModelConfig, config, dtype: torch.dtype, decode_gathers: bool) -> int:
    """Working memory beside the weights and the cache, estimated from the shapes: sampling over
    [max_batch_size, vocab] in float32 (logits, scaled, log-softmax, sorted values and their int64 order, noise:
    8 copies); one prefill step's activations (max_prefill_tokens x (16 hidden + 6 top_k x expert intermediate)
    values, where a step prefills at most max_batch_size x prefill_chunk tokens whatever max_prefill_tokens says);
    where decode gathers the blocks instead of the paged kernel (no triton), the gathered keys and
    values of the widest batch; and 1 GiB for the CUDA context, cuBLAS workspaces and allocator slack."""
    sampling = 8 * 4 * config.max_batch_size * arch.vocab_size
    per_token = 16 * arch.hidden_size + 6 * arch.num_experts_per_tok * arch.moe_intermediate_size
    prefill_tokens = min(config.max_prefill_tokens, config.max_batch_size * min(config.prefill_chunk, config.max_seq_len))
    prefill = prefill_tokens * per_token * dtype.itemsize
    gathered = 0
    if decode_gathers:
        per_layer = kv_bytes_per_token(arch, dtype) // arch.num_hidden_layers
        gathered = 2 * config.max_batch_size * config.max_seq_len * per_layer
    return sampling + prefill + gathered + (1 << 30)


def plan_memory(arch: MoEModelConfig, config, dtype: torch.dtype, *, weights: int, device: str = "cpu",
                total_bytes: int = 0, free_bytes: int = 0, decode_gathers: bool = False) -> MemoryPlan:
    """The plan for `config` (an EngineConfig). CUDA: total_bytes of the GPU and free_bytes that this process
    may take (free now, plus what the process already holds); CPU: total_bytes = 0."""
    P, S = config.kv_block_size, config.max_seq_len
    per_token = kv_bytes_per_token(arch, dtype)
    routing = 2 * len(arch.moe_layer_indices) * arch.num_experts_per_tok
    blocks_per_request = -(-S // P)
    plan = MemoryPlan(device, weights, 0, per_token, routing, P, 0, S, config.max_batch_size)
    if config.kv_cache_tokens:
        plan.num_blocks = -(-config.kv_cache_tokens // P)
    elif not total_bytes:  # CPU: every row a full-length request, as the slab was (+1: admission's headroom)
        plan.num_blocks = config.max_batch_size * blocks_per_request + 1
    if total_bytes:
        frac = config.gpu_memory_fraction
        plan.reserve_bytes = activation_reserve(arch, config, dtype, decode_gathers)
        plan.budget_bytes = int(min(frac * total_bytes, free_bytes or total_bytes))
        left = plan.budget_bytes - weights - plan.reserve_bytes
        others = f", {(total_bytes - free_bytes) / GB:.1f} GB used by others" if free_bytes < frac * total_bytes else ""
        where = f"rollout.gpu_memory_fraction={frac} of the GPU's {total_bytes / GB:.1f} GB{others}"
        if left <= 0:
            raise MemoryPlanError(
                f"the weights ({weights / GB:.1f} GB) and the activation reserve ({plan.reserve_bytes / GB:.1f} GB) "
                f"do not fit in {where} ({plan.budget_bytes / GB:.1f} GB): raise rollout.gpu_memory_fraction, free "
                f"the GPU, or use one with more memory")
        if not config.kv_cache_tokens:
            # Capped at every row at full length: more would only keep old prompts cached, and a small model
            # would take the whole GPU (and a per-block table on the host) for nothing.
            plan.num_blocks = min(left // (per_token * P), config.max_batch_size * blocks_per_request + 1)
        elif plan.kv_bytes > left:
            raise MemoryPlanError(
                f"rollout.kv_cache_tokens={config.kv_cache_tokens} needs {plan.kv_bytes / GB:.1f} GB of KV cache, but "
                f"{where} leaves {left / GB:.1f} GB after the weights and the reserve: lower rollout.kv_cache_tokens "
                f"(0 = size it from memory) or raise rollout.gpu_memory_fraction")
    if plan.num_blocks < blocks_per_request + 1:
        setting = ("rollout.kv_cache_tokens" if config.kv_cache_tokens or not total_bytes
                   else "rollout.gpu_memory_fraction")
        raise MemoryPlanError(
            f"the KV cache ({plan.tokens} tokens, {_size(plan.kv_bytes)}) cannot hold one request of "
            f"rollout.max_seq_len={S} (+ one block): raise {setting} or lower rollout.max_seq_len")
    return plan


def plan_for_device(arch: MoEModelConfig, config, dtype: torch.dtype, device: torch.device | str,
                    weights: int | None = None) -> MemoryPlan:
    """The plan on this device now. weights: the bytes of the model already loaded on it; None = not loaded
    yet (estimated from the architecture)."""
    device = torch.device(device)
    if device.type != "cuda":
        return plan_memory(arch, config, dtype, weights=weights or weight_bytes(arch, dtype), device=str(device))
    from moerl import kernels

    free, total = torch.cuda.mem_get_info(device)
    # Ours to take: what is free, what our allocator caches unused, and our own weights if loaded. Not the
    # memory of other live tensors of this process (another engine's cache, a trainer sharing the process).
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    gathers = not kernels.use_triton(torch.empty(0, dtype=dtype, device=device))
    return plan_memory(arch, config, dtype, weights=weights if weights is not None else weight_bytes(arch, dtype),
                       device=torch.cuda.get_device_name(device), total_bytes=total,
                       free_bytes=free + cached + (weights or 0), decode_gathers=gathers)
