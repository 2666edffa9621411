"""The rollout engine at Qwen3-30B-A3B's shape on one GPU: it starts, decodes 256 requests, records no autograd,
and its device memory stays inside its memory plan, the same on a second round (nothing accumulates).

This is the check that would have caught a dropped no-grad: with autograd on, every forward keeps its
activations and `moerl bench rollout --preset qwen3-30b-a3b` ran out of memory in its warm-up.
Random weights drawn on the GPU (61 GB in bf16); 256 requests x 128 prompt tokens x 64 new tokens at
temperature 1. The decode rate of the second round goes to the suite's summary (the benchmark is
`moerl bench rollout --preset qwen3-30b-a3b`).
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from moerl.bench.rollout import random_model
from moerl.bench.rollout_workload import qwen3_30b_a3b_config
from moerl.rollout import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.cuda_only

REQUESTS, PROMPT, NEW = 256, 128, 64
GiB = 1 << 30


def test_30b_a3b_engine_decodes_256_requests_within_its_memory_plan(device, report):
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    model = random_model(qwen3_30b_a3b_config(), torch.bfloat16, device, seed=0)
    assert all(p.requires_grad for p in model.parameters())  # as a trainer's: only the engine's guard keeps grad off
    grad_seen: list[bool] = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: grad_seen.append(out.requires_grad))
    engine = Engine(model, EngineConfig(max_batch_size=REQUESTS, max_seq_len=PROMPT + NEW, prefill_chunk=PROMPT))
    plan = engine.plan
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (REQUESTS, PROMPT), generator=gen).tolist()
    params = [SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=i) for i in range(REQUESTS)]
    peaks, rates = [], []
    for _ in range(2):
        torch.cuda.reset_peak_memory_stats(device)
        decode0, t0 = engine.stats["decode_tokens"], time.perf_counter()
        outs = engine.generate(prompts, params)
        torch.cuda.synchronize(device)
        rates.append((engine.stats["decode_tokens"] - decode0) / (time.perf_counter() - t0))
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        assert [len(c.token_ids) for c in outs] == [NEW] * REQUESTS
        assert all(c.finish_reason == "length" for c in outs)
    hook.remove()
    report(f"30B-A3B engine: {plan.describe()}")
    report(f"30B-A3B engine: peak allocated {peaks[0] / GiB:.1f} / {peaks[1] / GiB:.1f} GiB (rounds 1/2) of a "
           f"{plan.budget_bytes / GiB:.1f} GiB budget; {rates[1]:.0f} decode tok/s over a round (prefill included)")
    assert grad_seen and not any(grad_seen), "an engine forward recorded autograd"
    # The allocator's peak holds weights + cache + activations; the plan's budget also counts the CUDA context
    # and workspaces (in its 1 GiB reserve), which the allocator does not see.
    assert peaks[0] <= plan.budget_bytes, f"peak {peaks[0] / GiB:.1f} GiB over the plan's {plan.budget_bytes / GiB:.1f}"
    # What the plan reserves beside weights and cache covers the activations the allocator saw (graph pools too)
    activations = peaks[0] - plan.weight_bytes - plan.kv_bytes
    report(f"30B-A3B engine: activations and graph pools {activations / GiB:.2f} GiB of a "
           f"{plan.reserve_bytes / GiB:.2f} GiB reserve")
    assert activations <= plan.reserve_bytes
    assert peaks[1] <= peaks[0] + 256 * 2**20, f"the second round's peak grew: {peaks[0] / GiB:.2f} -> {peaks[1] / GiB:.2f} GiB"
    del engine, model, outs
    gc.collect()
    torch.cuda.empty_cache()
