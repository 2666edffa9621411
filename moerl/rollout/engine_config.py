"""The rollout engine's settings (`Engine(model, EngineConfig(...))`). Their own module: the engine (engine.py) and
the parts it drives (decode_pipeline.py) both read them, and the pipeline must not import the engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    max_batch_size: int = 64  # requests running at once (rows of the block table and of the decode batch)
    max_seq_len: int = 2048  # prompt + generated tokens per request
    prefill_chunk: int = 512  # tokens of one request per prefill forward
    max_prefill_tokens: int = 4096  # prefill tokens per step, so decode keeps running while prompts arrive
    cuda_graphs: bool = True  # capture decode in CUDA graphs (CUDA only)
    # Admit waiting requests once this many slots are free (or all that wait fit), 0 = max_batch_size // 8:
    # a prefill is an eager forward over the whole model, so admitting one request per step as others finish
    # would put one in nearly every decode step (measured: 3.1k tok/s instead of ~14k at 256 slots on an H200).
    admit_batch: int = 0
    deterministic: bool = False  # report log-probs/routing from one full forward (bitwise = the trainer's)
    seed: int = 0  # draws the seed of requests that bring none
    kv_block_size: int = 16  # positions per KV-cache block
    # KV-cache size in tokens; 0 = from gpu_memory_fraction on CUDA, max_batch_size x max_seq_len on CPU.
    kv_cache_tokens: int = 0
    gpu_memory_fraction: float = 0.9  # CUDA: the share of the GPU for weights + activation reserve + KV cache
    prefix_caching: bool = True  # requests whose prompts share full blocks share their keys/values
    # Launch decode step N+1 before reading step N's tokens (they stay on the device), so the host's bookkeeping
    # of step N runs while the device computes N+1. Same tokens, log-probs, versions and routing as without it,
    # bit for bit (docs/rollout.md, decode_pipeline.py). None: on CUDA only. On a CPU a launch computes at once, so
    # overlap hides nothing and the steps it computes for rows that just stopped are pure cost (the CPU demo: 81 s
    # for 600 steps with it, 66 s without); tests turn it on there to exercise the same logic.
    overlap_decode: bool | None = None
    # Sample only ids below this: the tokenizer's vocabulary when the model's embedding is padded past it (Qwen3's
    # 151936 rows for 151669 tokens); the padded ids decode to nothing. 0: every id of the model.
    vocab_limit: int = 0
