"""Overlapped decode (EngineConfig.overlap_decode, moerl/rollout/decode_pipeline.py) against the same engine
without it: the same tokens, log-probs, versions, routing and finish reasons bit for bit, and the same deltas
from every step() call, over stops, min_new_tokens, max_seq_len, admissions, chunked prefill, shared prefixes,
preemption, aborts, weight updates, continuations and deterministic mode.

On CPU a "launch" computes at once, but the pipeline's logic is the same as on CUDA: the next step is planned
and launched before the current step's tokens are read, a request that stopped is a padding row of the step
launched after it, and a launch that turns out not to be the step the engine runs is discarded. Each scenario
also checks that the overlapped engine did launch ahead (stats["overlap_steps"]), so none passes vacuously.
Unlike the other engine tests, log-probs are compared with ==: both engines run the very same forwards.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from moerl.rollout import Completion, Engine, EngineConfig, SamplingParams
from tests.unit.test_rollout_engine import PROMPTS, VOCAB, assert_same_completion, make_model

STOPS = tuple(range(3, VOCAB, 11))  # 12 of 128 ids: about one sampled token in ten ends its request


@pytest.fixture(scope="module")
def model():
    return make_model(0)


def params_mix(n: int, new: int = 14, **kw) -> list[SamplingParams]:
    """Greedy, temperature 1, top-k and top-p rows, with stop ids and min_new_tokens on some."""
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=12),
             dict(temperature=1.0, top_p=0.85), dict(temperature=1.0, top_k=30, top_p=0.9)]
    out = []
    for i in range(n):
        extra = dict(kinds[i % len(kinds)], stop_token_ids=STOPS if i % 4 != 3 else (),
                     min_new_tokens=3 if i % 3 == 1 else 0)
        extra.update(kw)
        out.append(SamplingParams(max_new_tokens=new + (i * 5) % 9, seed=1000 + i, **extra))
    return out


Event = Callable[[Engine, dict], None]


def drive(model, overlap: bool, prompts, params, events: dict[int, Event] | None = None, **config):
    """Submit, then step to the end, running events[k](engine, done) before the k-th step() call. Returns the
    completions by request id, every step's deltas, and the engine."""
    config.setdefault("max_seq_len", 48)
    engine = Engine(model, EngineConfig(overlap_decode=overlap, **config))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.submit(p, sp, request_id=f"r{i}")
    done: dict[str, Completion] = {}
    steps: list = []
    events = dict(events or {})
    k = 0
    while engine.has_unfinished() or any(e >= k for e in events):
        if k in events:
            events.pop(k)(engine, done)
        outs = engine.step()
        steps.append(sorted((o.request_id, o.new_token_ids, o.new_logprobs, o.completion is not None) for o in outs))
        for o in outs:
            if o.completion is not None:
                done[o.request_id] = o.completion
        k += 1
    return done, steps, engine


def assert_identical(a: Completion, b: Completion) -> None:
    assert a.token_ids == b.token_ids, a.request_id
    assert a.logprobs == b.logprobs, a.request_id  # bitwise: the same forwards ran
    assert a.versions == b.versions, a.request_id
    assert a.finish_reason == b.finish_reason, a.request_id
    assert torch.equal(a.routed_experts, b.routed_experts), a.request_id


def check_same(model, prompts, params, events_for=None, *, min_overlap: int = 1, max_discarded: int | None = None,
               alone: bool = False, **config):
    """Run both engines (events_for(): a fresh events dict per run) and compare everything. max_discarded: the
    most launches the overlapped engine may drop (admissions, prefills and stops of some rows cost none; all rows
    stopping at once, an abort or new weights one each). alone: also check
    each completion against its request run alone (one row, no look-ahead; batching changes float rounding,
    so log-probs within 1e-5): a fault both engines share (a ghost row writing into blocks it no longer owns,
    a wrong input id) shows there."""
    plain, plain_steps, e0 = drive(model, False, prompts, params, events_for() if events_for else None, **config)
    over, over_steps, e1 = drive(model, True, prompts, params, events_for() if events_for else None, **config)
    assert sorted(plain) == sorted(over)
    for rid in plain:
        assert_identical(plain[rid], over[rid])
    assert plain_steps == over_steps  # every step() call streamed the same deltas
    assert e0.stats["overlap_steps"] == 0 and e1.stats["overlap_steps"] >= min_overlap, e1.stats
    assert max_discarded is None or e1.stats["overlap_discarded"] <= max_discarded, e1.stats
    for key in ("decode_tokens", "decode_steps", "prefill_tokens", "prefix_hit_tokens", "preemptions"):
        assert e0.stats[key] == e1.stats[key], key
    for e in (e0, e1):  # every block back, nothing left in the pipeline
        assert e.cache.pool.num_free == e.plan.num_blocks and e.pipeline.plan is None and e.pipeline.inflight is None
    if alone:
        single = dict(config, max_batch_size=1, overlap_decode=False)
        single.setdefault("max_seq_len", 48)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            (want,) = Engine(model, EngineConfig(**single)).generate([p], sp)
            assert_same_completion(over[f"r{i}"], want, logprob_tol=1e-5)
    return plain, e0, e1


def test_stops_min_new_tokens_and_every_sampling_kind(model):
    prompts = PROMPTS * 2
    plain, _, over = check_same(model, prompts, params_mix(len(prompts)), max_batch_size=16, min_overlap=5,
                                max_discarded=1, alone=True)
    reasons = {c.finish_reason for c in plain.values()}
    assert reasons == {"stop", "length"}, reasons
    # a stop inside min_new_tokens does not end the request
    for i, c in enumerate(plain.values()):
        if c.finish_reason == "stop":
            assert len(c.token_ids) > params_mix(len(prompts))[int(c.request_id[1:])].min_new_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_max_seq_len_endings(model, temperature):
    params = [SamplingParams(max_new_tokens=100, temperature=temperature, seed=i) for i in range(len(PROMPTS))]
    plain, _, _ = check_same(model, PROMPTS, params, max_batch_size=8, max_seq_len=20, max_discarded=0)
    assert all(c.finish_reason == "length" and len(c.prompt_token_ids) + len(c.token_ids) == 20
               for c in plain.values())


@pytest.mark.parametrize("admit_batch", [1, 3])
def test_more_requests_than_slots_admitted_mid_decode(model, admit_batch):
    prompts = PROMPTS * 3
    check_same(model, prompts, params_mix(len(prompts), new=9), max_batch_size=4, admit_batch=admit_batch,
               min_overlap=40, max_discarded=1, alone=True)


def test_chunked_prefill_and_shared_prompts(model):
    """GRPO-like groups (the same prompt four times, prefilled once) with chunked prefill while others decode."""
    prompts = [PROMPTS[3]] * 4 + [PROMPTS[0]] * 4 + [PROMPTS[5], PROMPTS[1]]
    _, plain, _ = check_same(model, prompts, params_mix(len(prompts)), max_batch_size=6, prefill_chunk=3,
                             max_prefill_tokens=5, kv_block_size=2, min_overlap=30, max_discarded=1, alone=True)
    assert plain.stats["prefix_hit_tokens"] > 0


def test_long_prompt_prefilled_in_chunks_while_others_decode(model):
    """A long prompt arrives mid-run and is prefilled 3 tokens a step: the steps launched ahead for the decoding
    requests are kept across those prefill chunks (disjoint blocks) until its prefill completes and it joins."""
    long_prompt = [(7 * i + 3) % VOCAB for i in range(30)]

    def events():
        return {2: lambda engine, done: engine.submit(long_prompt, params_mix(5)[4], request_id="long")}
    check_same(model, PROMPTS[:3], params_mix(3, new=30, stop_token_ids=()), events, max_batch_size=4,
               prefill_chunk=3, max_prefill_tokens=3, min_overlap=20, max_discarded=0)
    engine = Engine(model, EngineConfig(max_batch_size=4, max_seq_len=48, prefill_chunk=3, max_prefill_tokens=3,
                                        overlap_decode=True))
    for i, p in enumerate(PROMPTS[:3]):
        engine.submit(p, params_mix(3, new=30, stop_token_ids=())[i])
    both = 0
    for k in range(20):
        if k == 2:
            engine.submit(long_prompt, params_mix(5)[4])
        prefilled, ahead = engine.stats["prefill_tokens"], engine.stats["overlap_steps"]
        engine.step()
        both += engine.stats["prefill_tokens"] > prefilled and engine.stats["overlap_steps"] > ahead
    assert both >= 5, "no step launched ahead survived a prefill chunk"


@pytest.mark.parametrize("block_size", [1, 4])
def test_preemption_under_a_small_cache(model, block_size):
    prompts = PROMPTS + [PROMPTS[3], PROMPTS[0]]
    params = params_mix(len(prompts), new=16, stop_token_ids=(7, 19))
    _, plain, _ = check_same(model, prompts, params, max_batch_size=8, max_seq_len=32, kv_cache_tokens=40,
                             kv_block_size=block_size, prefill_chunk=3, max_discarded=1, alone=True)
    assert plain.stats["preemptions"] > 0


def test_requests_submitted_mid_run(model):
    """New requests arriving between steps are admitted and prefilled while a step launched ahead is in flight,
    and join the step after it: no launch is discarded for them."""
    def events():
        def add(i):
            return lambda engine, done: engine.submit(PROMPTS[i % 6], params_mix(12)[i], request_id=f"late{i}")
        return {3: add(7), 4: add(8), 9: add(9), 10: add(10), 11: add(11)}
    check_same(model, PROMPTS[:3], params_mix(3, new=20, stop_token_ids=()), events, max_batch_size=8,
               min_overlap=20, max_discarded=0)


@pytest.mark.parametrize("at_step", [2, 5])
def test_abort_mid_run_and_continue(model, at_step):
    """Abort while a step for the request was launched ahead; the partial continues on the same engine."""
    def events():
        aborted: dict[str, Completion] = {}

        def abort(engine, done):
            aborted["r1"] = engine.abort("r1")
            aborted["r4"] = engine.abort("r4")

        def resubmit(engine, done):
            for rid, partial in aborted.items():
                done[rid + "-partial"] = partial
                engine.submit(partial.prompt_token_ids, params[int(rid[1:])], request_id=rid + "-cont",
                              prefix=partial)
        return {at_step: abort, at_step + 2: resubmit}
    params = params_mix(len(PROMPTS), new=16)
    plain, _, _ = check_same(model, PROMPTS, params, events, max_batch_size=8)
    assert plain["r1-partial"].finish_reason == "abort" and plain["r1-cont"].token_ids[: len(
        plain["r1-partial"].token_ids)] == plain["r1-partial"].token_ids


def test_update_weights_mid_run(model):
    """New weights land between two steps: the step launched ahead ran the old ones and is discarded; tokens
    sampled afterwards carry the new version and come from the new weights, as without overlap."""
    other = make_model(7)

    def events():
        def update(version):
            return lambda engine, done: engine.update_weights(other.state_dict() if version % 2 else
                                                              make_model(0).state_dict(), version)
        return {3: update(1), 6: update(2)}
    prompts = PROMPTS * 2
    plain, _, over = check_same(model, prompts, params_mix(len(prompts), new=12), events, max_batch_size=12)
    assert over.stats["overlap_discarded"] >= 2
    assert {v for c in plain.values() for v in c.versions} == {0, 1, 2}


def test_continuations_from_a_prefix(model):
    """Requests that continue an aborted partial (prefix=...) decode alike with and without overlap."""
    engine = Engine(model, EngineConfig(max_batch_size=8, max_seq_len=48))
    params = params_mix(len(PROMPTS), new=16)
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        engine.submit(p, sp, request_id=f"r{i}")
    for _ in range(5):
        engine.step()
    partials = [engine.abort(f"r{i}") for i in range(len(PROMPTS)) if f"r{i}" in engine.by_id]
    assert any(p.token_ids for p in partials)
    config = dict(max_batch_size=8, max_seq_len=48)
    runs = []
    for overlap in (False, True):
        e = Engine(model, EngineConfig(overlap_decode=overlap, **config))
        outs = e.generate([p.prompt_token_ids for p in partials], [params[int(p.request_id[1:])] for p in partials],
                          partials)
        runs.append((outs, e))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert_identical(a, b)
    assert runs[1][1].stats["overlap_steps"] > 0


def test_deterministic_mode(model):
    check_same(model, PROMPTS, params_mix(len(PROMPTS)), max_batch_size=8, deterministic=True)


def test_a_stopped_requests_extra_step_is_never_reported():
    """One request that stops: the step launched after its stop token computed it once more (as a padding row);
    that token appears nowhere, and the step is discarded unread (nothing else was in it)."""
    model = make_model(0)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3)
    plain = Engine(model, EngineConfig(max_batch_size=2, max_seq_len=48, overlap_decode=False))
    (c,) = plain.generate([PROMPTS[3]], params)
    first = next(i for i in range(4, 30) if c.token_ids[i] not in c.token_ids[:i])  # a token first sampled late
    over = Engine(model, EngineConfig(max_batch_size=2, max_seq_len=48, overlap_decode=True))
    params.stop_token_ids = (c.token_ids[first],)
    (d,) = over.generate([PROMPTS[3]], params)
    assert d.finish_reason == "stop" and d.token_ids == c.token_ids[: first + 1]
    assert over.stats["decode_tokens"] == first  # the first token came from the prefill
    # steps 2..first were launched ahead; so was the one after the stop, never read
    assert over.stats["overlap_steps"] == first - 1 and over.stats["overlap_discarded"] == 1
    assert over.cache.pool.num_free == over.plan.num_blocks


def test_engine_group_members_never_overlap(model, monkeypatch):
    """Ranks of an expert-parallel group must run the same forwards: the group turns overlap off (P > 1)."""
    import torch.distributed as dist

    from moerl.rollout import EngineGroup

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    for block in model.moe_blocks:
        monkeypatch.setattr(block.dispatcher, "world_size", 2, raising=False)
    group = EngineGroup(model, EngineConfig(max_batch_size=2, max_seq_len=32), group=object())
    assert not group.engine.config.overlap_decode and not group.engine.pipeline.overlap


def test_overlap_defaults_to_cuda_only(model):
    """None (the default) resolves by device: on a CPU a launch computes at once, so overlap would only add the
    steps of rows that just stopped."""
    assert EngineConfig().overlap_decode is None
    assert not Engine(model, EngineConfig(max_batch_size=2, max_seq_len=32)).pipeline.overlap
    assert Engine(model, EngineConfig(max_batch_size=2, max_seq_len=32, overlap_decode=True)).pipeline.overlap
