"""The paged KV cache: block bookkeeping, paged vs slab layout, shared prompt prefixes, preemption under a
small pool, and the memory plan.

Same tiny model as test_rollout_engine.py (clear logit and router margins): outputs of differently batched
runs agree token for token, routing exactly, log-probs within 1e-6. The slab layout is the same engine with
one block per request (kv_block_size = max_seq_len): what the slab cache was, a row of max_seq_len positions
per request.
"""

from __future__ import annotations

import math

import pytest
import torch

from moerl.kernels import paged_decode_reference
from moerl.model import MoEModelConfig
from moerl.rollout import Completion, Engine, EngineConfig, SamplingParams
from moerl.rollout.block_pool import BlockPool
from moerl.rollout.decode_graphs import DecodeBatch, DecodeGraphs
from moerl.rollout.memory import MemoryPlanError, activation_reserve, plan_memory, weight_bytes
from tests.unit.test_rollout_engine import (PROMPTS, assert_same_completion, full_forward_scores, greedy, make_model,
                                           seeded)


@pytest.fixture(scope="module")
def model():
    return make_model(0)


def paged(model, **kw) -> Engine:
    kw = {"max_seq_len": 32, "kv_block_size": 4, **kw}
    return Engine(model, EngineConfig(**kw))


def mixed_params(n: int, new: int) -> list[SamplingParams]:
    return [greedy(new) if i % 3 == 0 else seeded(new, 500 + i) for i in range(n)]


def test_block_pool_refcounts_prefix_keys_and_lru_eviction():
    pool = BlockPool(6, 2)  # block 0 is the null block: 5 usable
    assert pool.num_free == 5
    a = pool.allocate(2)
    assert 0 not in a and pool.num_free == 3
    parent = pool.register(a[0], 0, [1, 2], ready=False)
    pool.register(a[1], parent, [3, 4], ready=False)
    hit = pool.match([1, 2, 3, 4, 5], 2)
    assert hit.blocks == [] and hit.pending  # being computed: wait for it
    pool.mark_ready(a[0])
    hit = pool.match([1, 2, 3, 4, 5], 2)
    assert hit.blocks == [a[0]] and hit.pending
    pool.mark_ready(a[1])
    hit = pool.match([1, 2, 3, 4, 5], 2)
    assert hit.blocks == a and not hit.pending
    assert pool.match([1, 2, 9, 9], 2).blocks == [a[0]]  # the chain stops at the first differing block
    assert pool.match([3, 4], 1).blocks == []  # same tokens at another place in the chain: no match
    pool.take(hit.blocks)
    assert pool.refs[a[0]] == 2
    pool.release(a)
    pool.release(a)  # both owners gone: cached, still free to allocate
    assert pool.num_free == 5 and pool.match([1, 2, 3, 4], 2).blocks == a
    fresh = pool.allocate(3)  # plain blocks first: the cached ones survive
    assert set(fresh).isdisjoint(a) and pool.match([1, 2, 3, 4], 2).blocks == a
    evicted = pool.allocate(1)  # now one cached block goes: the sequence's last block (released first)
    assert evicted == [a[1]] and pool.match([1, 2, 3, 4], 2).blocks == [a[0]] and pool.evictions == 1
    pool.release(fresh + evicted)
    pool.clear_prefixes()  # new weights
    assert pool.match([1, 2, 3, 4], 2).blocks == [] and pool.num_free == 5


def test_paged_decode_reference_is_attention_over_each_rows_blocks():
    gen = torch.Generator().manual_seed(0)
    B, H, G, d, P, N, W = 3, 4, 2, 8, 4, 12, 5
    q = torch.randn(B, H, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(N, G, P, d, generator=gen, dtype=torch.float64) for _ in range(2))
    table = torch.randint(1, N, (B, W), generator=gen)
    seq_len = torch.tensor([1, 7, W * P])
    out = paged_decode_reference(q, k, v, table, seq_len)
    for b in range(B):
        n = int(seq_len[b])
        pos = torch.arange(n)
        keys, vals = k[table[b, pos // P], :, pos % P], v[table[b, pos // P], :, pos % P]  # [n, G, d]
        for h in range(H):
            g = h // (H // G)
            w = torch.softmax(keys[:, g] @ q[b, h] / math.sqrt(d), dim=0)
            assert torch.allclose(out[b, h], w @ vals[:, g], atol=1e-12)


@pytest.mark.parametrize("block_size", [1, 5])
def test_paged_equals_slab_layout_and_full_forward(model, block_size):
    prompts, params = PROMPTS, mixed_params(len(PROMPTS), 8)
    slab = paged(model, max_batch_size=3, prefill_chunk=4, kv_block_size=32).generate(prompts, params)
    engine = paged(model, max_batch_size=3, prefill_chunk=4, kv_block_size=block_size)
    outs = engine.generate(prompts, params)
    for p, a, b in zip(params, outs, slab):
        assert_same_completion(a, b, logprob_tol=1e-6)
        logp, routing = full_forward_scores(model, a, p.temperature)
        assert torch.allclose(torch.tensor(a.logprobs), logp, atol=1e-5, rtol=0)
        assert torch.equal(a.routed_experts.long(), routing)
    assert engine.cache.pool.num_free == engine.plan.num_blocks  # every block back
    assert engine.stats["preemptions"] == 0


def test_group_prefills_its_prompt_once_and_equals_unshared(model):
    prompt, G = PROMPTS[3], 4  # 11 tokens: two full blocks of 4 shared, a tail of 3 per sample
    params = [seeded(6, 900 + i) for i in range(G)]
    shared = paged(model, max_batch_size=G)
    alone = paged(model, max_batch_size=G, prefix_caching=False)
    outs = shared.generate([prompt] * G, params)
    want = alone.generate([prompt] * G, params)
    for a, b in zip(outs, want):
        assert_same_completion(a, b, logprob_tol=1e-6)  # routing of the shared prompt positions included
    assert alone.stats["prefill_tokens"] == G * len(prompt)
    assert shared.stats["prefill_tokens"] == len(prompt) + (G - 1) * 3
    assert shared.stats["prefix_hit_tokens"] == (G - 1) * 8
    # The prompt stays cached after the group: a later sample (or a continuation) starts from it.
    more = shared.generate([prompt], [seeded(6, 900)])[0]
    assert_same_completion(more, outs[0], logprob_tol=1e-6)
    assert shared.stats["prefix_hit_tokens"] == G * 8
    # New weights (the same values here) forget the cache: nothing computed by the old ones is reused.
    shared.update_weights(dict(model.state_dict()), version=1)
    shared.generate([prompt], [seeded(6, 900)])
    assert shared.stats["prefix_hit_tokens"] == G * 8


def test_continuation_from_another_worker_reuses_the_cached_prompt(model):
    prompt, params = PROMPTS[3], seeded(10, 77)
    full = paged(model).generate([prompt], params)[0]
    first = paged(model)
    rid = first.submit(prompt, params)
    for _ in range(3):
        first.step()
    partial = first.abort(rid)
    assert 0 < len(partial.token_ids) < 10
    here = paged(model, max_batch_size=2)
    here.generate([prompt], [seeded(3, 5)])  # a sibling sample computed this prompt here
    cont = here.generate([prompt], [params], [partial])[0]
    assert here.stats["prefix_hit_tokens"] == 8  # the prompt's full blocks; prompt + tokens is recomputed after them
    assert_same_completion(cont, full, logprob_tol=1e-6)


def test_preemption_under_a_small_pool_gives_the_unconstrained_outputs(model):
    prompts = PROMPTS + [PROMPTS[3], PROMPTS[0]]  # repeated prompts: sharing and preemption together
    params = mixed_params(len(prompts), 16)
    free = paged(model, max_batch_size=8).generate(prompts, params)
    # 10 blocks of 4 = 40 tokens: one request grows to 27; eight want up to 8 x 7 blocks.
    tight = paged(model, max_batch_size=8, kv_cache_tokens=40, prefill_chunk=3)
    outs = tight.generate(prompts, params)
    assert tight.stats["preemptions"] > 0
    for a, b in zip(outs, free):
        assert_same_completion(a, b, logprob_tol=1e-6)
        assert a.finish_reason == "length" and len(a.token_ids) == 16
    assert tight.cache.pool.num_free == 10


def test_abort_of_a_preempted_request_returns_its_tokens(model):
    engine = paged(model, max_batch_size=4, kv_cache_tokens=40)
    ids = [engine.submit(p, seeded(20, i)) for i, p in enumerate(PROMPTS[:4])]
    while not engine.stats["preemptions"]:
        engine.step()
    victim = next(r for r in engine.waiting if r.generated)
    partial = engine.abort(victim.id)
    assert partial.finish_reason == "abort" and partial.token_ids == victim.generated
    assert partial.routed_experts.shape[0] == len(partial.prompt_token_ids) + len(partial.token_ids) - 1
    cont = paged(model).generate([partial.prompt_token_ids], [seeded(20, ids.index(victim.id))], [partial])[0]
    alone = paged(model).generate([partial.prompt_token_ids], [seeded(20, ids.index(victim.id))])[0]
    assert_same_completion(cont, alone, logprob_tol=1e-6)


class _EagerGraph:
    """Stands in for a captured CUDA graph on CPU: replay() recomputes into the captured outputs."""

    def __init__(self, run) -> None:
        self.run, self.outs = run, run()

    def replay(self) -> None:
        for out, new in zip(self.outs, self.run()):
            out.copy_(new)


class EagerGraphs(DecodeGraphs):
    def _capture(self, n: int, hints: dict):
        batch = DecodeBatch.empty(n, self.width, self.device)
        graph = _EagerGraph(lambda: self.decode(batch, self.kv_len, hints))
        return graph, batch, graph.outs


def test_graph_shaped_decode_equals_eager(model):
    """What the CUDA graphs capture (a bucket-padded batch, the full-width block table, attention masked over the
    whole width, padding rows writing to the null block), run on CPU: the outputs of the eager decode."""
    prompts, params = PROMPTS + [PROMPTS[0]], mixed_params(len(PROMPTS) + 1, 10)
    want = paged(model, max_batch_size=5).generate(prompts, params)
    engine = paged(model, max_batch_size=5, kv_cache_tokens=48)
    c = engine.config
    engine.graphs = EagerGraphs(c.max_batch_size, engine.cache.width, engine.cache.width * c.kv_block_size,
                                engine.device, engine.decode_forward)
    for a, b in zip(engine.generate(prompts, params), want):
        assert_same_completion(a, b, logprob_tol=1e-6)
    assert {key[0] for key in engine.graphs.captured} >= {4, 5} and engine.stats["preemptions"] > 0


# ---------------------------------------------------------------------------------------------------
# Memory plan

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768)
H200_BYTES = 143771 * 2**20  # what the driver reports for a 141 GB H200


def test_cpu_plan_holds_every_slot_at_full_length(model):
    engine = paged(model, max_batch_size=3, max_seq_len=30, kv_block_size=4)
    assert engine.plan.num_blocks == 3 * 8 + 1 and engine.plan.max_full_requests == 3
    assert "25 blocks x 4" in engine.plan.describe()
    assert paged(model, kv_cache_tokens=41).plan.num_blocks == 11


def test_eks_p5en_rollout_settings_fit_one_h200_at_the_30b_shape():
    from moerl.config import load_config

    cfg = load_config("configs/eks-p5en.toml", [])
    config = EngineConfig(max_batch_size=cfg.rollout.max_batch_size, max_seq_len=cfg.rollout.max_seq_len,
                          gpu_memory_fraction=cfg.rollout.gpu_memory_fraction)
    arch = MoEModelConfig(**QWEN3_30B_A3B)
    weights = weight_bytes(arch, torch.bfloat16)
    assert 60e9 < weights < 62e9
    plan = plan_memory(arch, config, torch.bfloat16, weights=weights, device="H200", total_bytes=H200_BYTES,
                       free_bytes=H200_BYTES - 2**30)
    assert plan.weight_bytes + plan.kv_bytes + plan.reserve_bytes <= 0.9 * H200_BYTES
    assert plan.kv_bytes > 60e9 and plan.max_full_requests >= 100  # admission waits for blocks past that
    assert f"max_seq_len={cfg.rollout.max_seq_len}" in plan.describe()
    # The slab it replaces needed 256 x 5120 positions: more than the GPU holds next to the weights.
    assert 256 * 5120 * plan.kv_bytes_per_token + weights > H200_BYTES


def test_prefill_reserve_counts_the_tokens_a_step_can_prefill():
    """`moerl bench rollout` sets max_prefill_tokens=2**20 (prefill everything at once); a step still prefills at
    most max_batch_size x prefill_chunk tokens, and the reserve is sized from that (it asked 148 GB on an H200)."""
    arch = MoEModelConfig(**QWEN3_30B_A3B)
    bench = EngineConfig(max_batch_size=256, max_seq_len=384, prefill_chunk=128, max_prefill_tokens=1 << 20)
    plan = plan_memory(arch, bench, torch.bfloat16, weights=61 * 10**9, total_bytes=H200_BYTES,
                       free_bytes=H200_BYTES)
    assert plan.reserve_bytes < 8e9 and plan.max_full_requests >= 256
    small = EngineConfig(max_batch_size=256, max_seq_len=384, prefill_chunk=128, max_prefill_tokens=4096)
    assert activation_reserve(arch, small, torch.bfloat16, False) < plan.reserve_bytes


def test_memory_plan_errors_name_the_setting(model):
    arch = MoEModelConfig(**QWEN3_30B_A3B)
    config = EngineConfig(max_batch_size=256, max_seq_len=5120)
    with pytest.raises(MemoryPlanError, match=r"weights \(61\.0 GB\).*rollout\.gpu_memory_fraction=0\.9") as err:
        plan_memory(arch, config, torch.bfloat16, weights=61 * 10**9, total_bytes=48 * 10**9, free_bytes=48 * 10**9)
    assert "\n" not in str(err.value)
    with pytest.raises(MemoryPlanError, match=r"used by others"):  # other processes hold 90 GB of it
        plan_memory(arch, config, torch.bfloat16, weights=61 * 10**9, total_bytes=H200_BYTES,
                    free_bytes=60 * 10**9)
    # The weights fit, but what is left holds fewer than 5120 positions.
    with pytest.raises(MemoryPlanError, match=r"max_seq_len=5120.*raise rollout\.gpu_memory_fraction"):
        plan_memory(arch, config, torch.bfloat16, weights=61 * 10**9, total_bytes=71_250_000_000,
                    free_bytes=71_250_000_000)
    too_many = EngineConfig(max_batch_size=256, max_seq_len=5120, kv_cache_tokens=2_000_000)
    with pytest.raises(MemoryPlanError, match=r"rollout\.kv_cache_tokens=2000000 needs"):
        plan_memory(arch, too_many, torch.bfloat16, weights=61_000_000_000, total_bytes=H200_BYTES,
                    free_bytes=H200_BYTES)
    with pytest.raises(MemoryPlanError, match=r"cannot hold one request of rollout\.max_seq_len=32.*kv_cache_tokens"):
        paged(model, kv_cache_tokens=20)


def test_bad_paged_settings_are_refused(model):
    with pytest.raises(ValueError, match="kv_block_size"):
        paged(model, kv_block_size=0)
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        paged(model, gpu_memory_fraction=1.5)


def test_completion_roundtrip_after_preemption_keeps_versions(model):
    """Tokens sampled before a preemption keep their version; those after it carry the new one."""
    engine = paged(model, max_batch_size=4, kv_cache_tokens=40)
    ids = [engine.submit(p, greedy(20)) for p in PROMPTS[:4]]
    while not engine.stats["preemptions"]:
        engine.step()
    engine.update_weights({}, version=5)
    done: dict[str, Completion] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.completion is not None:
                done[out.request_id] = out.completion
    for rid, prompt in zip(ids, PROMPTS[:4]):
        c = done[rid]
        want = paged(model).generate([prompt], greedy(20))[0]
        assert c.token_ids == want.token_ids and 5 in c.versions and c.versions == sorted(c.versions)


def test_a_paged_kernel_that_fails_or_disagrees_leaves_decode_on_the_gather_path(monkeypatch, caplog):
    """The Triton paged decode is checked once per shape against the reference before decode uses it."""
    import sys
    import types

    from moerl import kernels

    def wrong(q_BHd, *args, **kwargs):
        return torch.zeros_like(q_BHd)

    def broken(*args, **kwargs):
        raise RuntimeError("out of shared memory")

    for fake, message in ((wrong, "disagrees"), (broken, "out of shared memory")):
        monkeypatch.setitem(sys.modules, "moerl.kernels.triton_paged", types.SimpleNamespace(paged_decode=fake))
        kernels.paged_decode_ok.cache_clear()
        with caplog.at_level("WARNING"):
            assert not kernels.paged_decode_ok(torch.device("cpu"), torch.float32, 4, 2, 8, 4)
        assert message in caplog.text
    monkeypatch.setitem(sys.modules, "moerl.kernels.triton_paged",
                        types.SimpleNamespace(paged_decode=kernels.paged_decode_reference))
    kernels.paged_decode_ok.cache_clear()
    assert kernels.paged_decode_ok(torch.device("cpu"), torch.float32, 4, 2, 8, 4)
    kernels.paged_decode_ok.cache_clear()
