"""The rollout engine: continuous batching, chunked prefill, per-request seeds, abort and continue,
weight updates, log-probs and routing against a full forward, deterministic mode, bad input.

Every model is tiny (hidden 32, 3 layers of which 2 are MoE, 6 experts, vocab 128) with weights of std 0.1, so
logits and router scores have clear margins (top-2 logit gaps > 1e-2): float noise between a cached decode and
a full forward never flips a greedy token or an expert choice, and token-for-token comparisons are meaningful.

Bitwise agreement between differently batched runs is not possible on CPU (a 1-row matmul takes another BLAS
path than a many-row one; grouped_mm's result depends on the group sizes), so log-probs of two engine runs are
compared within 1e-6 (a couple of float32 ulps at these magnitudes; larger weights amplify the noise past
that), and against a full forward within 1e-5; deterministic mode is compared bitwise.
"""

from __future__ import annotations

import pytest
import torch

from moerl.model import MoEModelConfig, build_model
from moerl.rollout import Completion, Engine, EngineConfig, SamplingParams
from moerl.rollout.sampling import SamplingBatch, sample

VOCAB = 128

PROMPTS = [
    [5, 17, 99, 3, 42, 8, 61],
    [11],
    [7, 7, 120, 64, 1],
    [33, 2, 90, 14, 76, 101, 9, 55, 23, 4, 87],
    [100, 6],
    [45, 46, 47, 48],
]


def make_config(**overrides) -> MoEModelConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
              mlp_only_layers=[1], initializer_range=0.1)
    kw.update(overrides)
    return MoEModelConfig(**kw)


def make_model(seed: int = 0, **overrides):
    return build_model(make_config(**overrides), seed=seed).eval()


@pytest.fixture(scope="module")
def model():
    return make_model(0)


def engine_for(model, **kw) -> Engine:
    kw.setdefault("max_seq_len", 64)
    return Engine(model, EngineConfig(**kw))


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def seeded(n: int, seed: int, **kw) -> SamplingParams:
    kw = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, **kw}
    return SamplingParams(max_new_tokens=n, seed=seed, **kw)


@torch.no_grad()
def reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """The plainest generation loop: a full forward over the whole sequence for every token, no cache."""
    tokens = list(prompt)
    for _ in range(params.max_new_tokens):
        logits_V = model(torch.tensor([tokens]))[0, -1]
        if params.greedy:
            tok = int(logits_V.argmax())
        else:
            batch = SamplingBatch.empty(1, "cpu")
            batch.set_rows([0], [params], [params.seed], [len(tokens)])
            tok = int(sample(logits_V[None], batch)[0][0])
        tokens.append(tok)
    return tokens[len(prompt):]


@torch.no_grad()
def full_forward_scores(model, completion: Completion, temperature: float):
    """(log-probs of the generated tokens, routing) from one forward over prompt + tokens[:-1]."""
    prompt, gen = completion.prompt_token_ids, completion.token_ids
    out = model.forward_full(torch.tensor([prompt + gen[:-1]]))
    temp = temperature or 1.0
    logp_TV = torch.log_softmax(out.logits_BTV[0, len(prompt) - 1:].float() / temp, dim=-1)
    return logp_TV.gather(1, torch.tensor(gen)[:, None]).squeeze(1), out.routed_experts_BTLK[0]


def assert_same_completion(a: Completion, b: Completion, logprob_tol: float = 1e-5) -> None:
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=logprob_tol, rtol=0)
    assert a.versions == b.versions
    assert a.finish_reason == b.finish_reason
    assert torch.equal(a.routed_experts.long(), b.routed_experts.long())


def run_to_end(engine: Engine) -> dict[str, Completion]:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.completion is not None:
                done[out.request_id] = out.completion
    return done


# ---------------------------------------------------------------------------------------------------
# Correctness against the model itself


def test_model_has_clear_margins(model):
    """Guard for the comparisons below: top-2 logit gaps are far above float32 noise."""
    logits = model(torch.tensor([PROMPTS[3]]))[0]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
    assert logits.std() > 0.5


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generate_matches_plain_loop_logprobs_and_routing(model, temperature):
    engine = engine_for(model, max_batch_size=4, prefill_chunk=4)
    params = [SamplingParams(max_new_tokens=9, temperature=temperature, seed=100 + i) for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, params)
    assert len(outs) == len(PROMPTS)
    for prompt, p, c in zip(PROMPTS, params, outs):
        assert c.prompt_token_ids == prompt
        assert c.finish_reason == "length" and c.error is None
        assert c.token_ids == reference(model, prompt, p)
        assert c.versions == [0] * 9
        assert c.seed == p.seed
        logp, routing = full_forward_scores(model, c, temperature)
        assert torch.allclose(torch.tensor(c.logprobs), logp, atol=1e-5, rtol=0)
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.routed_experts.shape == (len(prompt) + 9 - 1, 2, 2)
        assert not c.routed_experts.is_floating_point()
        assert torch.equal(c.routed_experts.long(), routing)
    # The prompts really produce different continuations (the engine does not mix rows up).
    assert len({tuple(c.token_ids) for c in outs}) >= 4
    assert not engine.has_unfinished() and not engine.by_id


def test_deterministic_mode_is_bitwise_the_full_forward(model):
    engine = engine_for(model, max_batch_size=3, prefill_chunk=3, deterministic=True)
    params = [greedy(7), SamplingParams(max_new_tokens=7, temperature=0.6, seed=5), seeded(7, 9)]
    outs = engine.generate(PROMPTS[:3], params)
    for p, c in zip(params, outs):
        logp, routing = full_forward_scores(model, c, p.temperature)
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), logp)
        assert torch.equal(c.routed_experts.long(), routing)
        assert c.routed_experts.shape[0] == len(c.prompt_token_ids) + len(c.token_ids) - 1
    # Same tokens as the non-deterministic engine; log-probs differ from it only by float noise.
    plain = engine_for(model, max_batch_size=3, prefill_chunk=3).generate(PROMPTS[:3], params)
    for a, b in zip(outs, plain):
        assert_same_completion(a, b, logprob_tol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Continuous batching, chunked prefill, seeds


def test_more_prompts_than_slots_same_as_alone(model):
    params = [greedy(6), seeded(6, 1), greedy(8), seeded(5, 2), seeded(7, 3), greedy(4)]
    engine = engine_for(model, max_batch_size=2, prefill_chunk=5)
    max_running = 0
    ids = [engine.submit(p, sp) for p, sp in zip(PROMPTS, params)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.completion is not None:
                done[out.request_id] = out.completion
        max_running = max(max_running, len(engine.running))
    assert max_running == 2 and engine.stats["decode_steps"] > 0
    for rid, prompt, sp in zip(ids, PROMPTS, params):
        alone = engine_for(model, max_batch_size=1).generate([prompt], sp)[0]
        assert_same_completion(done[rid], alone)
        assert len(done[rid].token_ids) == sp.max_new_tokens


def test_request_joining_mid_decode_same_as_alone(model):
    engine = engine_for(model, max_batch_size=4, prefill_chunk=4)
    first = engine.submit(PROMPTS[0], seeded(12, 7))
    streamed: dict[str, list[int]] = {}
    done = {}

    def step():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.completion is not None:
                done[out.request_id] = out.completion

    for _ in range(3):
        step()
    assert 0 < len(streamed[first]) < 12  # the first one is decoding
    second = engine.submit(PROMPTS[3], greedy(6))
    n_first = len(streamed[first])
    step()
    # In one step the newcomer ran its first prefill chunk while the first request decoded a token.
    prefilled = engine.stats["prefill_tokens"]
    assert len(streamed[first]) == n_first + 1 and prefilled == len(PROMPTS[0]) + 4
    third = engine.submit(PROMPTS[1], seeded(5, 8))
    while engine.has_unfinished():
        step()
    for rid, prompt, sp in [(first, PROMPTS[0], seeded(12, 7)), (second, PROMPTS[3], greedy(6)),
                            (third, PROMPTS[1], seeded(5, 8))]:
        alone = engine_for(model, max_batch_size=1).generate([prompt], sp)[0]
        assert_same_completion(done[rid], alone)
        assert streamed[rid] == done[rid].token_ids  # the stream adds up to the completion


@pytest.mark.parametrize("chunk,budget", [(1, 4096), (3, 4096), (4, 5), (2, 3)])
def test_chunked_prefill_same_as_one_chunk(model, chunk, budget):
    params = [greedy(5), seeded(5, 11), greedy(5), seeded(5, 12), greedy(5), seeded(5, 13)]
    big = engine_for(model, max_batch_size=6, prefill_chunk=512).generate(PROMPTS, params)
    small_engine = engine_for(model, max_batch_size=6, prefill_chunk=chunk, max_prefill_tokens=budget)
    small = small_engine.generate(PROMPTS, params)
    for a, b in zip(big, small):
        assert_same_completion(a, b)
    assert small_engine.stats["prefill_tokens"] > 0


def test_seeded_sampling_independent_of_batch(model):
    params = [seeded(10, 1000 + i) for i in range(len(PROMPTS))]
    together = engine_for(model, max_batch_size=8).generate(PROMPTS, params)
    reversed_ = engine_for(model, max_batch_size=3, prefill_chunk=2).generate(PROMPTS[::-1], params[::-1])[::-1]
    for prompt, p, a, b in zip(PROMPTS, params, together, reversed_):
        alone = engine_for(model, max_batch_size=1).generate([prompt], p)[0]
        assert_same_completion(a, alone)
        assert_same_completion(b, alone)
    # With other requests around, the same seed gives the same tokens; another seed gives others.
    crowd = [seeded(10, 1000)] + [seeded(10, s) for s in (1, 2, 3)]
    mixed = engine_for(model).generate([PROMPTS[0]] + PROMPTS[1:4], crowd)
    assert mixed[0].token_ids == together[0].token_ids
    other_seed = engine_for(model).generate([PROMPTS[0]], seeded(10, 1001))[0]
    assert other_seed.token_ids != together[0].token_ids


def test_unseeded_requests_get_distinct_reusable_seeds(model):
    engine = engine_for(model, seed=3)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    a, b = engine.generate([PROMPTS[0], PROMPTS[0]], params)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    assert a.token_ids != b.token_ids
    again = engine_for(model).generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, temperature=1.0, seed=a.seed))
    assert again[0].token_ids == a.token_ids


# ---------------------------------------------------------------------------------------------------
# Abort and continue


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("steps_before_abort", [1, 3, 6])
@pytest.mark.parametrize("chunk", [512, 3])
def test_abort_and_continue_on_new_engine(model, sampling, steps_before_abort, chunk):
    prompt = PROMPTS[3]
    params = greedy(10) if sampling == "greedy" else seeded(10, 77)
    company = (PROMPTS[0], seeded(20, 5))  # another request in the batch, in both runs

    def start(seed: int):
        engine = engine_for(model, max_batch_size=2, prefill_chunk=chunk, seed=seed)
        return engine, engine.submit(prompt, params), engine.submit(*company)

    engine, rid, _ = start(1)
    full = run_to_end(engine)[rid]
    assert full.finish_reason == "length" and len(full.token_ids) == 10

    engine, rid, other = start(1)
    for _ in range(steps_before_abort):
        engine.step()
    partial = engine.abort(rid)
    assert partial.finish_reason == "abort"
    assert partial.prompt_token_ids == prompt
    assert len(partial.token_ids) < 10
    assert partial.token_ids == full.token_ids[: len(partial.token_ids)]
    assert len(partial.logprobs) == len(partial.versions) == len(partial.token_ids)
    if partial.token_ids:
        assert partial.routed_experts.shape[0] == len(prompt) + len(partial.token_ids) - 1
    # Prefill takes ceil(11 / chunk) steps; the step that finishes it samples a token, and decode starts with the
    # next step (Engine.step: a request decodes from the step after its prefill).
    prefill_steps = -(-len(prompt) // chunk)
    want = steps_before_abort - prefill_steps + 1 if steps_before_abort >= prefill_steps else 0
    assert len(partial.token_ids) == want
    assert rid not in engine.by_id and other in engine.by_id
    with pytest.raises(KeyError, match=rid):
        engine.abort(rid)

    fresh = engine_for(model, max_batch_size=2, prefill_chunk=chunk, seed=999)  # same weights, new engine
    fresh.submit(PROMPTS[5], seeded(4, 3))
    rid2 = fresh.submit(prompt, params, prefix=partial)
    cont = run_to_end(fresh)[rid2]
    assert_same_completion(cont, full, logprob_tol=1e-6)
    assert cont.routed_experts.shape == (len(prompt) + 10 - 1, 2, 2)
    logp, routing = full_forward_scores(model, cont, params.temperature)
    assert torch.allclose(torch.tensor(cont.logprobs), logp, atol=1e-5, rtol=0)
    assert torch.equal(cont.routed_experts.long(), routing)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_abort_and_continue_deterministic_is_bitwise(model, sampling):
    params = greedy(9) if sampling == "greedy" else seeded(9, 31)
    prompt = PROMPTS[0]
    full = engine_for(model, deterministic=True).generate([prompt], params)[0]
    engine = engine_for(model, deterministic=True, max_batch_size=2)
    engine.submit(PROMPTS[2], seeded(9, 4))
    rid = engine.submit(prompt, params)
    for _ in range(4):
        engine.step()
    partial = engine.abort(rid)
    assert 0 < len(partial.token_ids) < 9
    cont = engine_for(model, deterministic=True, prefill_chunk=4).generate([prompt], params, [partial])[0]
    assert cont.token_ids == full.token_ids
    assert cont.logprobs == full.logprobs  # bitwise: both are the same full forward
    assert torch.equal(cont.routed_experts, full.routed_experts)
    assert cont.versions == full.versions == [0] * 9


def test_abort_before_any_token_and_seed_carried_by_prefix(model):
    """Abort while still in chunked prefill; continue with params that bring no seed (the prefix's is used)."""
    prompt = PROMPTS[3]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20)
    engine = engine_for(model, prefill_chunk=2, seed=4)
    rid = engine.submit(prompt, params)
    engine.step()
    partial = engine.abort(rid)
    assert partial.finish_reason == "abort" and partial.token_ids == [] and partial.seed is not None
    full = engine_for(model).generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20,
                                                                seed=partial.seed))[0]
    cont = engine_for(model, prefill_chunk=3).generate([prompt], params, prefixes=[partial])[0]
    assert_same_completion(cont, full)


def test_continuation_keeps_prefix_versions_and_tags_new_tokens(model):
    prompt = PROMPTS[0]
    engine = Engine(model, EngineConfig(max_seq_len=64), version=3)
    rid = engine.submit(prompt, greedy(9))
    engine.step()
    engine.step()
    partial = engine.abort(rid)
    k = len(partial.token_ids)
    assert 0 < k < 9 and partial.versions == [3] * k
    cont = Engine(model, EngineConfig(max_seq_len=64), version=4).generate([prompt], greedy(9), [partial])[0]
    assert cont.versions == [3] * k + [4] * (9 - k)
    assert cont.token_ids == reference(model, prompt, greedy(9))


def test_prefix_that_already_reached_max_new_tokens_finishes_at_once(model):
    full = engine_for(model).generate([PROMPTS[0]], greedy(5))[0]
    again = engine_for(model).generate([PROMPTS[0]], greedy(5), [full])[0]
    assert again.finish_reason == "length"
    assert_same_completion(again, full)


def test_bad_prefix_is_refused(model):
    full = engine_for(model).generate([PROMPTS[0]], greedy(3))[0]
    engine = engine_for(model)
    with pytest.raises(ValueError, match="prompt"):
        engine.submit(PROMPTS[1], greedy(5), prefix=full)
    broken = Completion(full.request_id, full.prompt_token_ids, full.token_ids, full.logprobs[:1], full.versions)
    with pytest.raises(ValueError, match="log-probs"):
        engine.submit(PROMPTS[0], greedy(5), prefix=broken)
    assert not engine.has_unfinished() and not engine.by_id


def test_prefix_with_bad_routing_is_refused_and_the_engine_keeps_going(model):
    full = engine_for(model).generate([PROMPTS[0]], greedy(5))[0]
    assert full.routed_experts.shape == (len(PROMPTS[0]) + 4, 2, 2)
    engine = engine_for(model)
    other = engine.submit(PROMPTS[1], greedy(4))
    part = engine_for(model).generate([PROMPTS[0]], greedy(2))[0]
    wrong_k = Completion("x", PROMPTS[0], part.token_ids, part.logprobs, part.versions,
                         torch.zeros(len(PROMPTS[0]) + 1, 2, 3, dtype=torch.int16))
    with pytest.raises(ValueError, match="routed_experts"):
        engine.submit(PROMPTS[0], greedy(5), prefix=wrong_k)
    too_long = Completion("x", PROMPTS[0], part.token_ids, part.logprobs, part.versions, full.routed_experts)
    with pytest.raises(ValueError, match="routed_experts"):
        engine.submit(PROMPTS[0], greedy(5), prefix=too_long)
    # A prefix without routing is fine: the engine records it while recomputing the prefix.
    no_routing = Completion("x", PROMPTS[0], part.token_ids, part.logprobs, part.versions)
    rid = engine.submit(PROMPTS[0], greedy(5), prefix=no_routing)
    done = run_to_end(engine)
    assert done[other].token_ids == reference(model, PROMPTS[1], greedy(4))
    assert_same_completion(done[rid], full)


def test_prefix_that_is_already_complete_is_reported_by_step(model):
    """submit() of a finished prefix: the next step() hands back its completion (streams must not hang)."""
    full = engine_for(model).generate([PROMPTS[0]], greedy(5))[0]
    engine = engine_for(model)
    rid = engine.submit(PROMPTS[0], greedy(5), prefix=full)
    assert engine.has_unfinished()
    outs = engine.step()
    assert [o.request_id for o in outs] == [rid]
    assert outs[0].new_token_ids == [] and outs[0].completion is not None
    assert_same_completion(outs[0].completion, full, logprob_tol=0.0)
    assert not engine.has_unfinished() and not engine.by_id
    # Aborting such a request before the step works too, and it is not reported again.
    rid = engine.submit(PROMPTS[0], greedy(5), prefix=full)
    assert engine.abort(rid).finish_reason == "length"
    assert engine.step() == [] and not engine.has_unfinished()


def test_async_stream_of_a_complete_prefix_ends(model):
    import asyncio

    from moerl.rollout import AsyncEngine

    full = engine_for(model).generate([PROMPTS[0]], greedy(5))[0]

    async def main():
        engine = AsyncEngine(engine_for(model))
        return [out async for out in engine.stream(PROMPTS[0], greedy(5), prefix=full)]

    outs = asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert len(outs) == 1 and outs[0].completion is not None
    assert outs[0].completion.token_ids == full.token_ids and outs[0].completion.finish_reason == "length"


def test_integer_like_token_ids_are_accepted_and_others_refused(model):
    np = pytest.importorskip("numpy")
    want = reference(model, PROMPTS[0], greedy(4))
    outs = engine_for(model).generate(
        [np.array(PROMPTS[0]), torch.tensor(PROMPTS[0]), [1, 2.5, 3], PROMPTS[0]], greedy(4))
    assert [c.finish_reason for c in outs] == ["length", "length", "error", "length"]
    assert outs[0].token_ids == outs[1].token_ids == outs[3].token_ids == want
    assert outs[0].prompt_token_ids == PROMPTS[0] and all(type(t) is int for t in outs[1].prompt_token_ids)
    assert "integer" in outs[2].error and "2.5" in outs[2].error


# ---------------------------------------------------------------------------------------------------
# Weight updates


def test_update_to_same_weights_switches_version_only(model):
    params = seeded(10, 21)
    base = engine_for(model).generate([PROMPTS[2]], params)[0]
    engine = engine_for(model, max_batch_size=2)
    rid = engine.submit(PROMPTS[2], params)
    k = 0
    for _ in range(3):
        for out in engine.step():
            assert out.completion is None
            k += len(out.new_token_ids)
    assert k == 3  # the first step samples after prefill; then one decoded token a step
    engine.update_weights({n: t.clone() for n, t in model.state_dict().items()}, version=7)
    assert engine.version == 7
    done = run_to_end(engine)
    c = done[rid]
    assert c.token_ids == base.token_ids
    assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(base.logprobs), atol=1e-6, rtol=0)
    assert c.versions == [0] * k + [7] * (10 - k)
    # An iterable of pairs works too.
    engine.update_weights(iter(list(model.state_dict().items())[:2]), version=8)
    assert engine.generate([PROMPTS[0]], greedy(2))[0].versions == [8, 8]


def test_update_to_other_weights_generates_like_that_model(model):
    other = make_model(seed=1)
    own = make_model(seed=0)  # a private copy: update_weights writes into the engine's model
    engine = engine_for(own, max_batch_size=3)
    before = engine.generate(PROMPTS[:3], greedy(8))
    engine.update_weights(other.state_dict(), version=1)
    after = engine.generate(PROMPTS[:3], greedy(8))
    want = engine_for(other, max_batch_size=3).generate(PROMPTS[:3], greedy(8))
    for a, b, w, prompt in zip(before, after, want, PROMPTS):
        assert b.token_ids == w.token_ids == reference(other, prompt, greedy(8))
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(w.logprobs), atol=1e-6, rtol=0)
        assert torch.equal(b.routed_experts, w.routed_experts)
        assert b.versions == [1] * 8 and a.versions == [0] * 8
    assert [a.token_ids for a in before] != [b.token_ids for b in after]


def test_update_weights_rejects_bad_names_and_shapes_without_touching_the_model():
    own = make_model(seed=0)
    engine = engine_for(own)
    before = {n: t.clone() for n, t in own.state_dict().items()}
    other = make_model(seed=1).state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(KeyError, match="no_such.weight"):
        engine.update_weights({name: other[name], "no_such.weight": torch.zeros(3)}, version=5)
    with pytest.raises(ValueError, match=r"q_proj\.weight.*shape"):
        engine.update_weights({"lm_head.weight": other["lm_head.weight"], name: torch.zeros(3, 3)}, version=5)
    assert engine.version == 0
    for n, t in own.state_dict().items():
        assert torch.equal(t, before[n]), f"{n} changed by a refused update"


# ---------------------------------------------------------------------------------------------------
# Lengths, stop tokens, bad input


def test_request_hitting_max_seq_len_finishes_with_length(model):
    engine = engine_for(model, max_seq_len=16, max_batch_size=2, prefill_chunk=4)
    outs = engine.generate([PROMPTS[3], PROMPTS[1], list(range(15))], greedy(50))
    for prompt, c in zip([PROMPTS[3], PROMPTS[1], list(range(15))], outs):
        assert c.finish_reason == "length"
        assert len(prompt) + len(c.token_ids) == 16
        assert c.routed_experts.shape[0] == 15
        assert c.token_ids == reference(model, prompt, greedy(16 - len(prompt)))


def test_stop_token_in_engine(model):
    base = engine_for(model).generate([PROMPTS[4]], greedy(10))[0]
    stop = base.token_ids[3]
    first = base.token_ids.index(stop)
    c = engine_for(model).generate([PROMPTS[4]], greedy(10, stop_token_ids=[stop, VOCAB - 1]))[0]
    assert c.finish_reason == "stop"
    assert c.token_ids == base.token_ids[: first + 1] and c.token_ids[-1] == stop
    assert c.routed_experts.shape[0] == len(PROMPTS[4]) + first


def test_bad_requests_fail_alone_in_generate(model):
    engine = engine_for(model, max_seq_len=12, max_batch_size=2)
    prompts = [PROMPTS[0], [], list(range(12)), [3, VOCAB, 4], PROMPTS[2], [5, -1], PROMPTS[4]]
    params = [greedy(4)] * 4 + [SamplingParams(max_new_tokens=4, top_p=0.0)] + [greedy(4)] * 2
    outs = engine.generate(prompts, params)
    reasons = [c.finish_reason for c in outs]
    assert reasons == ["length", "error", "error", "error", "error", "error", "length"]
    assert "empty" in outs[1].error
    assert "max_seq_len" in outs[2].error and "12" in outs[2].error
    assert "vocabulary" in outs[3].error and str(VOCAB) in outs[3].error
    assert "top_p" in outs[4].error
    assert "vocabulary" in outs[5].error and "-1" in outs[5].error
    for c, prompt in zip(outs, prompts):
        assert c.prompt_token_ids == prompt
        if c.finish_reason == "error":
            assert c.token_ids == [] and c.logprobs == []
        else:
            assert c.error is None
            assert c.token_ids == reference(model, prompt, greedy(4))
    assert not engine.has_unfinished()
    # The engine keeps working after refusing requests.
    assert engine.generate([PROMPTS[0]], greedy(4))[0].token_ids == outs[0].token_ids


@pytest.mark.parametrize("prompt,params,match", [
    ([], greedy(3), "empty"),
    (list(range(64)), greedy(3), "max_seq_len"),
    ([1, 2, 200], greedy(3), "vocabulary"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ([1, 2], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
    ([1, 2], SamplingParams(top_k=-2), "top_k"),
])
def test_submit_raises_value_error(model, prompt, params, match):
    engine = engine_for(model)
    with pytest.raises(ValueError, match=match):
        engine.submit(prompt, params)
    assert not engine.has_unfinished() and not engine.by_id
    engine.submit([1, 2], greedy(2), request_id="ok")
    with pytest.raises(ValueError, match="already"):
        engine.submit([1, 2], greedy(2), request_id="ok")
    assert run_to_end(engine)["ok"].token_ids == reference(model, [1, 2], greedy(2))


def test_abort_unknown_request(model):
    with pytest.raises(KeyError, match="nope"):
        engine_for(model).abort("nope")


@pytest.mark.parametrize("field,value", [("max_batch_size", 0), ("max_seq_len", 1), ("prefill_chunk", 0),
                                         ("max_prefill_tokens", 0)])
def test_bad_engine_config_is_refused(model, field, value):
    with pytest.raises(ValueError, match=field):
        Engine(model, EngineConfig(**{field: value}))


# ---------------------------------------------------------------------------------------------------
# No autograd, whoever drives the engine


def test_no_engine_forward_records_autograd(model):
    """Every forward the engine runs (step, generate, a group's phases called one by one, deterministic
    rescoring) runs without autograd even when the caller has it on: a recorded graph keeps every step's
    activations alive (a refactor that dropped Engine.step's no-grad grew memory ~9 GB per 400 decode steps)."""
    grad_model = make_model(0)  # parameters require grad, as a trainer's do
    assert all(p.requires_grad for p in grad_model.parameters())
    seen: list[tuple[bool, bool]] = []

    # every forward ends in the vocabulary projection (a module call, so it can be hooked)
    handle = grad_model.lm_head.register_forward_hook(
        lambda m, a, out: seen.append((torch.is_grad_enabled(), out.requires_grad)))
    with torch.enable_grad():
        engine = engine_for(grad_model, max_batch_size=4)
        engine.submit(PROMPTS[0], seeded(3, 1))
        outs = [o for o in engine.step()]  # the public step
        engine.generate(PROMPTS[1:3], seeded(4, 2))  # generate's loop
        # an engine group composes these phases without step(): each must hold on its own
        engine.submit(PROMPTS[3], seeded(3, 3))
        outputs = engine.start_step()
        for n, reqs in engine.prefill_batches():
            engine.run_prefill(reqs, n, outputs)
        engine.finish(outputs)
        while reqs := engine.decode_batch():
            engine.run_decode(reqs, outputs)
            engine.finish(outputs)
        det = engine_for(grad_model, max_batch_size=2, deterministic=True)
        (completion,) = det.generate([PROMPTS[4]], seeded(3, 4))
    handle.remove()
    assert outs and completion.token_ids
    assert len(seen) >= 8, seen
    assert not any(grad for grad, _ in seen), "an engine forward ran with autograd on"
    assert not any(req for _, req in seen), "an engine forward's output requires grad"


def test_engine_refuses_a_model_whose_experts_are_split_over_ranks(model, monkeypatch):
    """A plain Engine on an expert-parallel model would wait forever in its first MoE layer for the other ranks;
    it is refused at once, naming EngineGroup (which may take such a model)."""
    split = make_model(0)
    for block in split.moe_blocks:
        monkeypatch.setattr(block.dispatcher, "world_size", 2)
    with pytest.raises(ValueError, match=r"experts are split over 2 ranks .* run an EngineGroup"):
        Engine(split, EngineConfig(max_seq_len=64))
    Engine(split, EngineConfig(max_seq_len=64), group_member=True)  # what EngineGroup builds
