"""Sampling: parameter validation, greedy/top-k/top-p, the sampled distribution, the hash-keyed Gumbel noise,
and stop tokens / min_new_tokens in the engine."""

from __future__ import annotations

import math

import pytest
import torch

from moerl.model import MoEModelConfig, build_model
from moerl.rollout import Engine, EngineConfig, SamplingParams
from moerl.rollout.sampling import SamplingBatch, gumbel_noise, sample

V8_LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])


def batch_of(params: list[SamplingParams], positions: list[int]) -> SamplingBatch:
    b = SamplingBatch.empty(len(params), "cpu")
    b.set_rows(list(range(len(params))), params, [p.seed or 0 for p in params], positions)
    return b


def draw(logits_V: torch.Tensor, n: int, *, seeds=None, positions=None, **kw) -> torch.Tensor:
    """n samples from one distribution: one row per (seed, position)."""
    seeds = list(range(n)) if seeds is None else seeds
    positions = [7] * n if positions is None else positions
    params = [SamplingParams(seed=s, **kw) for s in seeds]
    tokens, _ = sample(logits_V.expand(n, -1), batch_of(params, positions))
    return tokens


def frequencies(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).float() / tokens.numel()


def chi_square(freq: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    support = probs > 0
    return float((n * (freq[support] - probs[support]) ** 2 / probs[support]).sum())


# ---------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("field,kw", [
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.01)),
    ("top_p", dict(top_p=-0.5)),
    ("top_p", dict(top_p=float("nan"))),
    ("top_k", dict(top_k=-1)),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("max_new_tokens", dict(max_new_tokens=-3)),
    ("min_new_tokens", dict(min_new_tokens=-1)),
    ("stop_token_ids", dict(stop_token_ids=[3, 50])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2**63)),
])
def test_validate_names_the_field(field, kw):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kw).validate(vocab_size=50)


def test_validate_accepts_the_edges():
    for kw in [dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-9), dict(top_k=0), dict(top_k=10_000),
               dict(max_new_tokens=1), dict(stop_token_ids=[0, 49]), dict(seed=0), dict(seed=2**63 - 1)]:
        SamplingParams(**kw).validate(vocab_size=50)
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=1e-3).greedy


def test_bad_stop_token_message_lists_the_ids():
    with pytest.raises(ValueError, match=r"\[50, 77\].*\[0, 50\)"):
        SamplingParams(stop_token_ids=[1, 50, 77]).validate(vocab_size=50)


# ---------------------------------------------------------------------------------------------------
# Greedy, top-k = 1, tiny top-p, log-probs


def random_logits(B: int, V: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(B, V, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_with_temperature_one_logprobs():
    logits = random_logits(16, 50)
    params = [SamplingParams(temperature=0.0, seed=s, top_k=3, top_p=0.5) for s in range(16)]
    tokens, logprobs = sample(logits, batch_of(params, list(range(16))))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=5, top_p=1e-3)])
def test_top_k_one_and_tiny_top_p_are_greedy(temperature, kw):
    logits = random_logits(64, 40, seed=1)
    params = [SamplingParams(temperature=temperature, seed=1000 + s, **kw) for s in range(64)]
    tokens, logprobs = sample(logits, batch_of(params, [3 * s for s in range(64)]))
    assert torch.equal(tokens, logits.argmax(-1))
    # The log-prob is under the full softmax(logits / T), not the filtered distribution (which would give 0).
    want = torch.log_softmax(logits / temperature, -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs, want, atol=1e-6)
    assert (logprobs < 0).all()


def test_logprobs_are_full_vocabulary_under_each_rows_temperature():
    logits = random_logits(6, 30, seed=2)
    temps = [0.0, 0.3, 1.0, 1.7, 0.0, 4.0]
    params = [SamplingParams(temperature=t, seed=s, top_k=4, top_p=0.8) for s, t in enumerate(temps)]
    tokens, logprobs = sample(logits, batch_of(params, [0] * 6))
    for i, t in enumerate(temps):
        want = torch.log_softmax(logits[i] / (t or 1.0), -1)[tokens[i]]
        assert torch.allclose(logprobs[i], want, atol=1e-6)
    top4 = logits.topk(4, dim=-1).indices
    assert all(int(tokens[i]) in top4[i].tolist() for i in range(6))


def test_bf16_logits_sample_in_float32():
    logits = random_logits(4, 30, seed=3).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0)] * 4
    tokens, logprobs = sample(logits, batch_of(params, [0] * 4))
    assert logprobs.dtype == torch.float32
    assert torch.equal(tokens, logits.float().argmax(-1))


def test_fast_paths_agree_with_the_general_sampler():
    """all_greedy / any_filter=False are shortcuts: same tokens and log-probs as the general path."""
    logits = random_logits(12, 40, seed=5)
    greedy_rows = [SamplingParams(temperature=0.0, seed=s) for s in range(12)]
    b = batch_of(greedy_rows, list(range(12)))
    t0, l0 = sample(logits, b)
    t1, l1 = sample(logits, b, all_greedy=True)
    assert torch.equal(t0, t1) and torch.allclose(l0, l1, atol=1e-6)
    plain = [SamplingParams(temperature=[0.0, 0.8, 1.0, 1.5][i % 4], seed=40 + i) for i in range(12)]
    b = batch_of(plain, [5 + i for i in range(12)])
    t0, l0 = sample(logits, b)
    t1, l1 = sample(logits, b, any_filter=False)
    assert torch.equal(t0, t1) and torch.allclose(l0, l1, atol=1e-6)
    assert len(set(t0.tolist())) > 4


# ---------------------------------------------------------------------------------------------------
# The sampled distribution


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_empirical_distribution_matches_softmax_over_seeds(temperature):
    n = 4000
    tokens = draw(V8_LOGITS, n, temperature=temperature)
    freq, probs = frequencies(tokens, 8), torch.softmax(V8_LOGITS / temperature, -1)
    assert (freq - probs).abs().max() < 0.03
    assert chi_square(freq, probs, n) < 24.3  # 99.9% quantile of chi-square with 7 degrees of freedom
    assert (freq > 0).all()


def test_empirical_distribution_matches_softmax_over_positions():
    """One seed, many positions: the noise is fresh at every position of a sequence."""
    n = 4000
    tokens = draw(V8_LOGITS, n, seeds=[12345] * n, positions=list(range(n)))
    freq, probs = frequencies(tokens, 8), torch.softmax(V8_LOGITS, -1)
    assert (freq - probs).abs().max() < 0.03
    assert chi_square(freq, probs, n) < 24.3


def test_top_k_keeps_only_the_largest_renormalised():
    n = 4000
    tokens = draw(V8_LOGITS, n, temperature=1.0, top_k=3)
    freq = frequencies(tokens, 8)
    top3 = V8_LOGITS.topk(3).indices  # tokens 4, 7, 0
    assert sorted(torch.nonzero(freq).flatten().tolist()) == sorted(top3.tolist())
    want = torch.zeros(8)
    want[top3] = torch.softmax(V8_LOGITS[top3], -1)
    assert (freq - want).abs().max() < 0.03
    assert chi_square(freq, want, n) < 13.8  # 99.9% quantile, 2 degrees of freedom


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.25, 0.015, 0.4, 0.1, 0.03, 0.15, 0.005])
    logits = probs.log()
    n = 4000
    # Sorted: 0.4, 0.25, 0.15 | 0.1 ... The mass before 0.1 is 0.8 >= 0.7, so three tokens remain.
    tokens = draw(logits, n, temperature=1.0, top_p=0.7)
    freq = frequencies(tokens, 8)
    kept = [3, 1, 6]
    assert sorted(torch.nonzero(freq).flatten().tolist()) == sorted(kept)
    want = torch.zeros(8)
    want[kept] = probs[kept] / probs[kept].sum()
    assert (freq - want).abs().max() < 0.03
    # top_k and top_p together: the stricter wins.
    both = frequencies(draw(logits, n, temperature=1.0, top_p=0.7, top_k=2), 8)
    assert sorted(torch.nonzero(both).flatten().tolist()) == [1, 3]
    assert abs(float(both[3]) - 0.4 / 0.65) < 0.03


def test_temperature_applies_before_top_p():
    """At temperature 0.5 the top token holds 0.4^2 / sum(p^2) = 0.53 of the mass: top_p=0.5 keeps it alone."""
    probs = torch.tensor([0.05, 0.25, 0.015, 0.4, 0.1, 0.03, 0.15, 0.005])
    tokens = draw(probs.log(), 500, temperature=0.5, top_p=0.5)
    assert (tokens == 3).all()
    tokens = draw(probs.log(), 500, temperature=1.0, top_p=0.5)
    assert set(tokens.tolist()) == {1, 3}


# ---------------------------------------------------------------------------------------------------
# Gumbel noise keyed by (seed, position, token)


def test_gumbel_noise_is_a_pure_function_of_seed_position_token():
    seeds = torch.tensor([0, 1, 2**62 + 5, 2**63 - 1, 42])
    pos = torch.tensor([0, 9, 3, 2047, 9])
    a, b = gumbel_noise(seeds, pos, 64), gumbel_noise(seeds.clone(), pos.clone(), 64)
    assert torch.equal(a, b)
    assert a.shape == (5, 64) and a.dtype == torch.float32 and torch.isfinite(a).all()
    # Each row is the same in any batch, any order, any batch size.
    for i in range(5):
        alone = gumbel_noise(seeds[i: i + 1], pos[i: i + 1], 64)
        assert torch.equal(alone[0], a[i])
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert torch.equal(gumbel_noise(seeds[perm], pos[perm], 64), a[perm])
    bigger = gumbel_noise(torch.cat([seeds, torch.arange(100, 120)]), torch.cat([pos, torch.arange(20)]), 64)
    assert torch.equal(bigger[:5], a)
    # The noise of token v does not depend on the vocabulary size either.
    assert torch.equal(gumbel_noise(seeds, pos, 200)[:, :64], a)
    # Another seed or another position gives other noise.
    assert not torch.equal(a[1], gumbel_noise(torch.tensor([1]), torch.tensor([10]), 64)[0])
    assert not torch.equal(a[1], gumbel_noise(torch.tensor([7]), torch.tensor([9]), 64)[0])
    assert not torch.equal(a[4], a[1])  # same position, other seed


def test_gumbel_noise_has_the_gumbel_distribution():
    g = gumbel_noise(torch.arange(2000), torch.full((2000,), 5), 128).flatten().double()
    euler_gamma = 0.5772156649
    assert abs(float(g.mean()) - euler_gamma) < 0.01
    assert abs(float(g.var()) - math.pi ** 2 / 6) < 0.03
    # P(g <= 0) = exp(-1)
    assert abs(float((g <= 0).double().mean()) - math.exp(-1)) < 0.005


def test_sample_row_does_not_depend_on_the_rest_of_the_batch():
    logits = random_logits(10, 40, seed=4, scale=1.0)
    params = [SamplingParams(temperature=[1.0, 0.7, 0.0, 1.3][i % 4], top_p=[1.0, 0.9][i % 2], top_k=[0, 20, 5][i % 3],
                             seed=500 + i) for i in range(10)]
    positions = [11 + 2 * i for i in range(10)]
    tokens, logprobs = sample(logits, batch_of(params, positions))
    for i in range(10):
        t, lp = sample(logits[i: i + 1], batch_of([params[i]], [positions[i]]))
        assert int(t) == int(tokens[i])
        assert torch.allclose(lp, logprobs[i: i + 1], atol=1e-6)
    rev = list(range(9, -1, -1))
    t_rev, _ = sample(logits[rev], batch_of([params[i] for i in rev], [positions[i] for i in rev]))
    assert torch.equal(t_rev, tokens[rev])
    # Sampling at temperature 1 really is random across seeds (not stuck on the argmax).
    spread = draw(logits[0], 200, temperature=1.0)
    assert len(set(spread.tolist())) > 10


# ---------------------------------------------------------------------------------------------------
# Stop tokens and min_new_tokens in the engine


@pytest.fixture(scope="module")
def model():
    cfg = MoEModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, initializer_range=0.1)
    return build_model(cfg, seed=3).eval()


PROMPT = [3, 14, 15, 9, 26]


def repeated_token(tokens: list[int]) -> tuple[int, int, int]:
    """(token, first index, second index) of the first token that occurs twice."""
    for j, t in enumerate(tokens):
        if t in tokens[:j]:
            return t, tokens.index(t), j
    raise AssertionError(f"no repeated token in {tokens}")


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=24, temperature=0.0),
                                    SamplingParams(max_new_tokens=24, temperature=1.0, top_k=6, seed=8)])
def test_stop_token_ends_with_stop_and_is_included(model, params):
    base = Engine(model, EngineConfig(max_seq_len=64)).generate([PROMPT], params)[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    stop = base.token_ids[4]
    first = base.token_ids.index(stop)
    kw = dict(vars(params), stop_token_ids=[stop])
    out = Engine(model, EngineConfig(max_seq_len=64)).generate([PROMPT], SamplingParams(**kw))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[: first + 1] and out.token_ids[-1] == stop
    assert out.logprobs == pytest.approx(base.logprobs[: first + 1], abs=1e-6)
    assert len(out.versions) == first + 1
    assert out.routed_experts.shape[0] == len(PROMPT) + first


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=24, temperature=0.0),
                                    SamplingParams(max_new_tokens=24, temperature=1.0, top_k=6, seed=8)])
def test_min_new_tokens_ignores_stop_tokens_before_it(model, params):
    base = Engine(model, EngineConfig(max_seq_len=64)).generate([PROMPT], params)[0]
    stop, i, j = repeated_token(base.token_ids)
    assert i < j
    # Stop tokens among the first min_new_tokens tokens are ignored; the first one after ends it.
    kw = dict(vars(params), stop_token_ids=[stop], min_new_tokens=i + 1)
    out = Engine(model, EngineConfig(max_seq_len=64)).generate([PROMPT], SamplingParams(**kw))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == base.token_ids[: j + 1]
    assert out.token_ids[i] == stop  # this earlier stop token did not end the request
    # A stop token right at index min_new_tokens counts.
    kw = dict(vars(params), stop_token_ids=[stop], min_new_tokens=i)
    out = Engine(model, EngineConfig(max_seq_len=64)).generate([PROMPT], SamplingParams(**kw))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: i + 1]
    # With min_new_tokens past every occurrence, the request runs to max_new_tokens.
    kw = dict(vars(params), stop_token_ids=[stop], min_new_tokens=24)
    out = Engine(model, EngineConfig(max_seq_len=64)).generate([PROMPT], SamplingParams(**kw))[0]
    assert out.finish_reason == "length" and out.token_ids == base.token_ids


def test_stop_on_the_first_token_finishes_in_prefill(model):
    base = Engine(model, EngineConfig(max_seq_len=64)).generate([PROMPT], SamplingParams(max_new_tokens=3,
                                                                                          temperature=0.0))[0]
    engine = Engine(model, EngineConfig(max_seq_len=64))
    rid = engine.submit(PROMPT, SamplingParams(max_new_tokens=3, temperature=0.0, stop_token_ids=[base.token_ids[0]]))
    outs = engine.step()
    assert len(outs) == 1 and outs[0].request_id == rid
    assert outs[0].new_token_ids == base.token_ids[:1]
    c = outs[0].completion
    assert c is not None and c.finish_reason == "stop" and c.token_ids == base.token_ids[:1]
    assert c.routed_experts.shape[0] == len(PROMPT)
    assert not engine.has_unfinished() and engine.stats["decode_steps"] == 0


def test_gumbel_uniform_never_reaches_one():
    """The largest draw must stay below 1: with 24 bits + 0.5 it rounded to 1.0 in float32 (noise +inf), and that
    token was sampled whatever its probability (~0.85% of rows at a 152k vocabulary)."""
    from moerl.rollout.sampling import gumbel_at, uniform_of

    bits = torch.tensor([0, 1, (1 << 31) - 1, 0xFFFFFEFF, 0xFFFFFFFF], dtype=torch.int64)
    u = uniform_of(bits)
    assert bool((u > 0).all()) and bool((u < 1).all()), u.tolist()
    g = gumbel_at(torch.arange(64), torch.zeros(64, dtype=torch.int64), torch.arange(4096)[None].expand(64, -1))
    assert torch.isfinite(g).all()


# ---------------------------------------------------------------------------------------------------
# A model vocabulary padded past the tokenizer's (issue 37 item 13): those ids are never sampled


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                dict(temperature=1.0, top_p=0.9)])
def test_ids_past_the_vocab_limit_are_never_sampled_and_logprobs_stay_full_vocabulary(kw):
    logits_V = torch.cat([V8_LOGITS, torch.full((4,), 9.0)])  # 4 padded ids, each more likely than any real one
    n = 256
    params = [SamplingParams(seed=s, **kw) for s in range(n)]
    batch = batch_of(params, [5] * n)
    token_B, logprob_B = sample(logits_V.expand(n, -1), batch, vocab_limit=8)
    assert int(token_B.max()) < 8
    t = kw["temperature"] or 1.0
    full = torch.log_softmax(logits_V / t, dim=-1)
    assert torch.allclose(logprob_B, full[token_B], atol=1e-6)  # what the trainer recomputes
    unlimited, _ = sample(logits_V.expand(n, -1), batch)
    assert int(unlimited.min()) >= 8  # without the limit the padded ids win
    inside, _ = sample(V8_LOGITS.expand(n, -1), batch)
    assert torch.equal(token_B, inside)  # the same draws as a model of exactly 8 ids


def test_the_engine_samples_within_the_tokenizers_vocabulary():
    cfg = MoEModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, initializer_range=0.1)
    padded = build_model(cfg, seed=3).eval()
    with torch.no_grad():
        padded.lm_head.weight[48:] = padded.lm_head.weight[:16] * 50  # padded rows that dominate every logit
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=4)
    assert max(Engine(padded, EngineConfig(max_seq_len=64)).generate([PROMPT], params)[0].token_ids) >= 48
    out = Engine(padded, EngineConfig(max_seq_len=64, vocab_limit=48)).generate([PROMPT], params)[0]
    assert max(out.token_ids) < 48 and len(out.token_ids) == 12


def test_a_run_limits_sampling_to_its_tokenizer_and_refuses_a_smaller_model_vocabulary():
    from moerl import preflight, run
    from moerl.config import load_config
    from moerl.preflight import PreflightError
    from moerl.tasks.arithmetic import ArithmeticTask

    cfg, task = load_config(None, []), ArithmeticTask()
    padded = run.model_architecture(cfg, task)
    padded.vocab_size = task.tokenizer.vocab_size + 45
    worker, _ = run._specs(cfg, padded, task)
    assert worker.engine.vocab_limit == task.tokenizer.vocab_size == 259
    exact, _ = run._specs(cfg, run.model_architecture(cfg, task), task)
    assert exact.engine.vocab_limit == 0
    small = run.model_architecture(cfg, task)
    small.vocab_size = 200
    with pytest.raises(PreflightError, match="tokenizer has 259 ids .* vocabulary has 200"):
        preflight.check_tokenizer(task, small)
