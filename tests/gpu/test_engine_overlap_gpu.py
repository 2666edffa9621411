"""Overlapped decode (EngineConfig.overlap_decode) on the GPU, with CUDA graphs: the overlapped engine gives the
plain engine's tokens, log-probs, versions, routing and finish reasons bit for bit (both run the very same
graph replays and prefills; overlap only launches a step before the previous one is read), and the suite's
summary gets the decode rate with overlap on and off.

CUDA: the 0.9b preset of `moerl bench rollout` (random init on the GPU, bf16). Equality: 128 requests (64 slots,
so admissions mid-decode) with mixed sampling, stop ids that end about half the requests early, mixed lengths,
and a weight update (a new version) mid-run. Rate: 128 requests x 128-token prompts x 64 new tokens at
temperature 1, no stops, each engine warmed (graphs captured) first, best of two runs each.
CPU smoke (MOERL_GPU_SUITE_ON_CPU=1): the tiny preset, eager, a few requests.
"""

from __future__ import annotations

import time

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


def _decode_rate(engine: Engine, prompts, new: int, device) -> float:
    """Decode tok/s: tokens after each request's first / time after the last first token (as bench rollout)."""
    params = [SamplingParams(max_new_tokens=new, temperature=1.0, seed=i) for i in range(len(prompts))]
    for p, sp in zip(prompts, params):
        engine.submit(p, sp)
    first_at, generated = None, 0
    started = set()
    while engine.has_unfinished():
        for out in engine.step():
            generated += len(out.new_token_ids)
            if out.new_token_ids:
                started.add(out.request_id)
        if first_at is None and len(started) == len(prompts):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_at, first_tokens = time.perf_counter(), generated
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (generated - first_tokens) / (time.perf_counter() - first_at)


def test_overlapped_decode_rate(setup, device, report):
    model, config, shape = setup
    prompts = prompts_for(config, shape, seed=3)
    engines = {overlap: engine_for(model, shape, shape["requests"], overlap) for overlap in (False, True)}
    for engine in engines.values():  # capture every graph the timed runs use
        _decode_rate(engine, prompts, shape["new"], device)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(2):
        for overlap, engine in engines.items():
            rates[overlap].append(_decode_rate(engine, prompts, shape["new"], device))
    off, on = max(rates[False]), max(rates[True])
    n, p, t = shape["requests"], shape["prompt"], shape["new"]
    report(f"overlapped decode ({'0.9b' if device.type == 'cuda' else 'tiny'}, {n} x {p} prompt x {t} new, "
           f"temperature 1, graphs {'on' if engines[True].graphs is not None else 'off'}): "
           f"{on:,.0f} decode tok/s with overlap vs {off:,.0f} without ({on / off:.3f}x); "
           f"{engines[True].stats['overlap_steps']} steps launched ahead, "
           f"{engines[True].stats['overlap_discarded']} discarded")
    assert engines[True].stats["overlap_steps"] > 0
