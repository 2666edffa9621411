"""The rollout engine at Qwen3-30B-A3B's shape on one GPU: it starts, decodes 256 requests, records no autograd,
and its device memory stays inside its memory plan, the same on a second round (nothing accumulates); and
configs/eks-p5en.toml's rollout settings serve a GRPO-like load there.

This is the check that would have caught a dropped no-grad: with autograd on, every forward keeps its
activations and `moerl bench rollout --preset qwen3-30b-a3b` ran out of memory in its warm-up.
Random weights drawn on the GPU (61 GB in bf16); 256 requests x 128 prompt tokens x 64 new tokens at
temperature 1. The decode rate at this shape is `moerl bench rollout --preset qwen3-30b-a3b`'s to measure.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from moerl.bench.rollout import random_model
from moerl.bench.rollout_workload import qwen3_30b_a3b_config
from moerl.config import load_config
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
    peaks = []
    for _ in range(2):
        torch.cuda.reset_peak_memory_stats(device)
        outs = engine.generate(prompts, params)
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        assert [len(c.token_ids) for c in outs] == [NEW] * REQUESTS
        assert all(c.finish_reason == "length" for c in outs)
    hook.remove()
    report(f"30B-A3B engine: {plan.describe()}")
    report(f"30B-A3B engine: peak allocated {peaks[0] / GiB:.1f} / {peaks[1] / GiB:.1f} GiB (rounds 1/2) of a "
           f"{plan.budget_bytes / GiB:.1f} GiB budget")
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


EKS_GROUPS, EKS_PROMPT, EKS_NEW = 16, 1000, 128


@torch.no_grad()
def test_eks_p5en_rollout_settings_serve_a_grpo_load_at_the_30b_shape(device, report):
    """configs/eks-p5en.toml's rollout engine (256 x 5,120, the KV cache from gpu_memory_fraction, prefix caching)
    at Qwen3-30B-A3B's shape on one GPU: it starts, and a GRPO-like load runs inside its plan: 16 groups of 16
    samples of one 1,000-token prompt each, 128 new tokens at temperature 1. Its cache holds the whole load
    without sharing a block (an H200 plans 723,728 tokens, the load needs 288,768), so nothing is preempted;
    with sharing, each group's later samples take their prompt's full blocks from the prefix cache (238,080
    tokens on an H200 at 1,024 new tokens). Formerly scripts/gpu/paged_decode_check.py --eks."""
    r = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "eks-p5en.toml"), []).rollout
    config = EngineConfig(max_batch_size=r.max_batch_size, max_seq_len=r.max_seq_len, kv_block_size=r.kv_block_size,
                          kv_cache_tokens=r.kv_cache_tokens, gpu_memory_fraction=r.gpu_memory_fraction,
                          prefix_caching=r.prefix_caching)
    requests = EKS_GROUPS * EKS_GROUPS
    assert config.max_batch_size == requests, "the load is one batch of the config's rows"
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model = random_model(qwen3_30b_a3b_config(), torch.bfloat16, device, seed=0)
    engine = Engine(model, config)
    plan = engine.plan
    report(f"eks-p5en rollout at the 30B-A3B shape: {plan.describe()}")
    assert plan.tokens >= requests * (EKS_PROMPT + EKS_NEW), "the cache cannot hold the load without sharing"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (EKS_PROMPT,), generator=gen).tolist()
               for _ in range(EKS_GROUPS)]
    params = [SamplingParams(max_new_tokens=EKS_NEW, temperature=1.0, seed=i) for i in range(requests)]
    outs = engine.generate([p for p in prompts for _ in range(EKS_GROUPS)], params)
    torch.cuda.synchronize(device)
    peak, st = torch.cuda.max_memory_allocated(device) - base, engine.stats
    report(f"eks-p5en rollout at the 30B-A3B shape: {requests} samples of {EKS_NEW} tokens, prefix-cache hits "
           f"{st['prefix_hit_tokens']} tokens, {st['preemptions']} preemptions, peak {peak / GiB:.1f} GiB of the "
           f"plan's {plan.budget_bytes / GiB:.1f} GiB budget")
    assert [len(c.token_ids) for c in outs] == [EKS_NEW] * requests
    assert st["preemptions"] == 0 and st["prefix_hit_tokens"] > 0
    assert peak <= plan.budget_bytes, f"peak {peak / GiB:.1f} GiB over the plan's {plan.budget_bytes / GiB:.1f}"
    del engine, model, outs
    gc.collect()
    torch.cuda.empty_cache()
