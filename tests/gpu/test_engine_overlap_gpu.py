"""Overlapped decode (EngineConfig.overlap_decode) on the GPU, with CUDA graphs: the overlapped engine gives the
plain engine's tokens, log-probs, versions, routing and finish reasons bit for bit (both run the very same
graph replays and prefills; overlap only launches a step before the previous one is read). The decode rate it
buys is `moerl bench rollout --overlap-ablation`'s to measure.

CUDA: the 0.9b preset of `moerl bench rollout` (random init on the GPU, bf16): 128 requests (64 slots, so
admissions mid-decode) with mixed sampling, stop ids that end about half the requests early, mixed lengths, and
a weight update (a new version) mid-run.
CPU smoke (MOERL_GPU_SUITE_ON_CPU=1): the tiny preset, eager, a few requests.
"""

from __future__ import annotations

import pytest
import torch

from moerl.bench.rollout import random_model
from moerl.bench.rollout_workload import bench_model_config
from moerl.model import tiny_config
from moerl.rollout import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def setup(device, dtype):
    on_cuda = device.type == "cuda"
    config = bench_model_config() if on_cuda else tiny_config()
    model = random_model(config, dtype, device, seed=0)
    shape = dict(requests=128, prompt=128, new=64, slots=64) if on_cuda else dict(requests=8, prompt=8, new=8, slots=4)
    return model, config, shape


def engine_for(model, shape: dict, slots: int, overlap: bool) -> Engine:
    max_seq_len = shape["prompt"] + shape["new"] + 16
    # An explicit cache size: two engines share the GPU (the default would give the first 90% of it).
    return Engine(model, EngineConfig(max_batch_size=slots, max_seq_len=max_seq_len, overlap_decode=overlap,
                                      kv_cache_tokens=slots * max_seq_len, prefill_chunk=4096,
                                      max_prefill_tokens=8192))


def prompts_for(config, shape: dict, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (shape["requests"], shape["prompt"]), generator=gen).tolist()


def test_overlapped_decode_equals_plain_bitwise_with_cuda_graphs(setup, device):
    model, config, shape = setup
    gen = torch.Generator().manual_seed(1)
    stops = tuple(torch.randperm(config.vocab_size, generator=gen)[: max(4, config.vocab_size // 100)].tolist())
    kinds = [dict(temperature=1.0), dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.8, top_k=40)]
    params = [SamplingParams(max_new_tokens=shape["new"] // 2 + (i * 7) % (shape["new"] // 2 + 1), seed=i,
                             stop_token_ids=stops if i % 3 else (), min_new_tokens=i % 5, **kinds[i % len(kinds)])
              for i in range(shape["requests"])]
    prompts = prompts_for(config, shape, seed=2)
    runs = []
    for overlap in (False, True):
        engine = engine_for(model, shape, shape["slots"], overlap)
        ids = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
        done, steps = {}, 0
        while engine.has_unfinished():
            if steps == 6:  # the same weights as a new version: a step launched ahead is discarded, versions move
                engine.update_weights(list(model.state_dict().items())[:1], 1)
            for out in engine.step():
                if out.completion is not None:
                    done[out.request_id] = out.completion
            steps += 1
        runs.append(([done[i] for i in ids], engine))
    (plain, e0), (over, e1) = runs
    if device.type == "cuda":
        for e in (e0, e1):
            assert e.graphs is not None and e.graphs.disabled_reason is None, "decode graphs were not captured"
    assert e1.stats["overlap_steps"] > 0 and e1.stats["overlap_discarded"] > 0 and e0.stats["overlap_steps"] == 0
    reasons = {c.finish_reason for c in plain}
    assert reasons == {"stop", "length"}, reasons
    for a, b in zip(plain, over, strict=True):
        assert a.token_ids == b.token_ids, a.request_id
        assert a.logprobs == b.logprobs, a.request_id
        assert a.versions == b.versions and a.finish_reason == b.finish_reason, a.request_id
        assert torch.equal(a.routed_experts, b.routed_experts), a.request_id
    assert {v for c in plain for v in c.versions} == {0, 1}

