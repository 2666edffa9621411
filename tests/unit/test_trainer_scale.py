"""The trainer at scale, on one process: float32 master weights under bf16 compute, token-budget micro-batches
equal to the whole batch, activation checkpointing equal to none, token-balanced rank shares."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moerl.model import build_model, tiny_config
from moerl.train.batching import micro_batches, pack, positions, split_by_tokens
from moerl.train.config import LossConfig, OptimConfig
from moerl.train.trainer import PolicyTrainer, Sample

ARCH = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            mlp_only_layers=[1])


def samples(n: int = 10, seed: int = 0, routed: bool = True) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = 2 + (i * 3) % 5, 1 + (i * 7) % 6
        r = torch.rand(p + c - 1, 2, 8, generator=g).argsort(-1)[..., :2].to(torch.int16) if routed else None
        out.append(Sample(torch.randint(0, 96, (p,), generator=g).tolist(), torch.randint(0, 96, (c,), generator=g).tolist(),
                          (-torch.rand(c, generator=g) - 0.3).tolist(), float(i % 3 - 1), r))
    return out


def trainer(**kw) -> PolicyTrainer:
    optim = kw.pop("optim", OptimConfig(lr=1e-3, grad_clip=0.0))
    loss = kw.pop("loss", LossConfig())
    return PolicyTrainer(build_model(tiny_config(**ARCH), seed=0, dtype=kw.pop("dtype", torch.float32)), optim,
                         loss, **kw)


def grads(t: PolicyTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


def assert_grads_close(a: dict, b: dict, rtol: float) -> None:
    assert sorted(a) == sorted(b)
    for n in a:
        err = (a[n].double() - b[n].double()).norm() / b[n].double().norm().clamp(min=1e-30)
        assert err <= rtol, f"{n}: relative error {err:.2e}"


# ------------------------------------------------------------------------------ batching
def test_split_by_tokens_balances_tokens_and_keeps_every_sample_once():
    batch = samples(11)
    shares = split_by_tokens(batch, 3)
    assert sorted(id(s) for share in shares for s in share) == sorted(id(s) for s in batch)
    tokens = [sum(positions(s) for s in share) for share in shares]
    assert max(tokens) - min(tokens) <= max(positions(s) for s in batch)
    assert shares == split_by_tokens(batch, 3)  # deterministic


@pytest.mark.parametrize("budget", [1, 9, 20, 1000])
def test_micro_batches_respect_the_budget(budget):
    batch = samples(10)
    bins = micro_batches(batch, budget)
    assert sorted(id(s) for b in bins for s in b) == sorted(id(s) for s in batch)
    for b in bins:
        assert len(b) == 1 or sum(positions(s) for s in b) <= budget


def test_pack_has_no_padding_and_keeps_each_positions_routing():
    batch = samples(4)
    p = pack(batch, 2, 2, "cpu")
    assert p.num_tokens == sum(positions(s) for s in batch) and p.routed_1TLK.shape == (1, p.num_tokens, 2, 2)
    start = 0
    for i, s in enumerate(batch):
        n = positions(s)
        assert torch.equal(p.routed_1TLK[0, start: start + n], s.routed_experts.long())
        assert p.input_ids_1T[0, start: start + n].tolist() == (s.prompt_ids + s.completion_ids)[:-1]
        assert p.mask_SP[i].sum() == len(s.completion_ids)
        start += n


# ------------------------------------------------------------------------------ micro-batches
@pytest.mark.parametrize("budget", [1, 7, 25])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_any_budget_gives_the_whole_batch_gradient(budget, aggregation):
    loss = LossConfig(aggregation=aggregation, entropy_coef=0.01)
    whole, micro = trainer(loss=loss), trainer(loss=loss, micro_batch_tokens=budget)
    batch = samples(10)
    m_whole, m_micro = whole.rl_step(batch), micro.rl_step(batch)
    assert_grads_close(grads(micro), grads(whole), 1e-6)
    assert m_micro["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-6)
    assert m_micro["loss/policy"] == pytest.approx(m_whole["loss/policy"], rel=1e-5, abs=1e-7)
    assert m_micro["expert_counts"] == m_whole["expert_counts"]


@pytest.mark.parametrize("mode", [True, "selective"])
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_activation_checkpointing_gives_the_same_gradient(compute_dtype, mode):
    """Under bf16 compute too: the recompute in backward sees the same cast weights as the forward."""
    plain = trainer(aux_loss_coef=0.01, compute_dtype=compute_dtype)
    ckpt = trainer(aux_loss_coef=0.01, compute_dtype=compute_dtype, activation_checkpointing=mode)
    batch = samples(6)
    plain.rl_step(batch)
    ckpt.rl_step(batch)
    assert_grads_close(grads(ckpt), grads(plain), 1e-6)
    params = dict(ckpt.model.named_parameters())  # the master parameters are back in place, float32
    assert len(params) == len(dict(plain.model.named_parameters()))
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in params.values())


# ------------------------------------------------------------------------------ mixed precision
def _changed_frac(before: dict, after: dict, name: str) -> float:
    return float((before[name] != after[name]).float().mean())


def test_fp32_master_weights_move_at_lr_1e6_under_bf16_compute():
    optim = OptimConfig(lr=1e-6, grad_clip=0.0)
    unclipped = LossConfig(trust_region="none")  # every token has a gradient: the random behaviour log-probs
    mixed = trainer(optim=optim, loss=unclipped, compute_dtype=torch.bfloat16)  # would clip some experts' all away
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    before = {n: p.detach().clone() for n, p in mixed.model.named_parameters()}
    metrics = mixed.rl_step(samples(10))
    after = dict(mixed.model.named_parameters())
    matrices = [n for n in before if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                                 "experts.gate_up_proj", "experts.down_proj"))]
    assert len(matrices) == 3 * 4 + 2 * 2
    for n in matrices:
        assert _changed_frac(before, after, n) >= 0.99, n
    assert metrics["update/param_change_frac"] >= 0.95
    assert all(p.grad.dtype == torch.float32 for p in mixed.model.parameters() if p.grad is not None)
    published = mixed.publish_state()  # weights in the compute dtype; the router's expert bias in its own float32
    assert all(v.dtype == (torch.float32 if k.endswith("expert_bias") else torch.bfloat16)
               for k, v in published.items() if v.is_floating_point())

    # the failure this fixes: AdamW directly on bf16 weights rounds a 1e-6 update away almost everywhere
    pure = trainer(optim=optim, loss=unclipped, dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in pure.model.named_parameters()}
    pure.rl_step(samples(10))
    after = dict(pure.model.named_parameters())
    assert max(_changed_frac(before, after, n) for n in matrices) < 0.5


def test_bf16_compute_matches_an_autocast_free_reference_in_float32_roughly():
    """The cast path computes in bf16 (not silently in float32): its loss differs from the float32 one by
    bf16 rounding, not by nothing and not by more."""
    batch = samples(6)
    fp32 = trainer().rl_step(batch)["loss/policy"]
    bf16 = trainer(compute_dtype=torch.bfloat16).rl_step(batch)["loss/policy"]
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=5e-2, abs=5e-3)


# ------------------------------------------------------------------------------ on-policy agreement
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_trainer_logprobs_match_the_rollouts_at_its_temperature(temperature):
    """On the rollout's own weights the importance weights are 1: the trainer scores tokens under the same
    softmax(logits / temperature) the engine sampled from (first step: proximal = current = behaviour)."""
    from moerl.rollout import Engine, EngineConfig, SamplingParams

    model = build_model(tiny_config(**ARCH), seed=0)
    engine = Engine(build_model(tiny_config(**ARCH), seed=0), EngineConfig(max_batch_size=4, max_seq_len=64))
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    done = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=temperature, seed=3,
                                                   stop_token_ids=[]))
    batch = [Sample(c.prompt_token_ids, c.token_ids, c.logprobs, 1.0, c.routed_experts) for c in done]
    metrics = PolicyTrainer(model, OptimConfig(lr=1e-6), LossConfig(), temperature=temperature).rl_step(batch)
    assert metrics["is/weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert abs(metrics["is/behaviour_kl"]) < 1e-6
    if temperature != 1.0:  # scoring at temperature 1 would be off-policy by construction
        plain = PolicyTrainer(build_model(tiny_config(**ARCH), seed=0), OptimConfig(lr=1e-6), LossConfig())
        off = plain.rl_step(batch)
        assert off["is/behaviour_kl"] > 1e-4 and off["is/weight_max"] > 1.01


def test_token_ids_outside_the_vocabulary_are_named_before_any_work():
    t = trainer()
    batch = samples(4)
    vocab = t.model.config.vocab_size
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    batch[2] = dataclasses.replace(batch[2], completion_ids=[*batch[2].completion_ids[:-1], vocab])
    with pytest.raises(ValueError, match=rf"sample 2: completion_ids holds ids in \[\d+, {vocab}\], outside the "
                                         rf"vocabulary \[0, {vocab}\)"):
        t.rl_step(batch)
    assert t.steps_done == 0
    assert all(torch.equal(p, before[n]) for n, p in t.model.named_parameters())


# ------------------------------------------------------------------------------ trust regions (issue 35)
def on_policy(t: PolicyTrainer, batch: list[Sample]) -> list[Sample]:
    """The batch with behaviour log-probs = the trainer's own now: a fresh rollout of these weights."""
    return [dataclasses.replace(s, behaviour_logprobs=lp.tolist()) for s, lp in zip(batch, t.token_logprobs(batch))]


def test_several_updates_per_step_make_the_proximal_clip_act(monkeypatch):
    """At 4dcea02 the proximal log-probs were the current ones: ratio 1, clip_frac 0 on every step. With two updates
    the first sees ratio 1 against the step-start policy, the second a moved policy, and the clip acts on it."""
    from moerl.train import trainer as trainer_module

    seen: list[list[dict]] = []
    original = trainer_module.merge_updates
    monkeypatch.setattr(trainer_module, "merge_updates", lambda updates: seen.append(updates) or original(updates))
    loss = LossConfig(trust_region="proximal", is_correction="tis")
    t = trainer(optim=OptimConfig(lr=1e-1, grad_clip=0.0), loss=loss, minibatches=2)
    batch = on_policy(t, samples(12))
    metrics = t.rl_step(batch)
    first, second = seen[0]
    assert first["policy/ratio_max"] == pytest.approx(1.0, abs=1e-5) and first["policy/clip_frac"] == 0.0
    assert second["policy/clip_frac"] > 0 and second["policy/ratio_max"] > 1.28
    assert metrics["optim/updates"] == 2.0 and t.steps_done == 2
    assert metrics["policy/clip_frac"] > 0 and metrics["time/proximal_s"] >= 0
    assert metrics["tokens"] == first["tokens"] + second["tokens"] == sum(len(s.completion_ids) for s in batch)
    old = trainer(optim=OptimConfig(lr=1e-1, grad_clip=0.0), loss=LossConfig(trust_region="none"))
    assert old.rl_step(batch)["policy/clip_frac"] == 0.0  # 4dcea02's objective: nothing to clip against


def test_one_update_with_the_proximal_trust_region_is_refused():
    with pytest.raises(ValueError, match="train.minibatches >= 2"):
        trainer(loss=LossConfig(trust_region="proximal"))


def test_ess_scaling_shrinks_the_step_by_sqrt_ess():
    """VCPO's rule: the update of a batch whose weights concentrate moves the weights sqrt(ESS) as far (AdamW's
    first step is lr x sign-like, so the step's size is proportional to the learning rate)."""
    batch = samples(10)  # random behaviour log-probs: w spread, ESS < 1
    moves = {}
    for scaling in (False, True):
        t = trainer(optim=OptimConfig(lr=1e-3, grad_clip=0.0), loss=LossConfig(ess_lr_scaling=scaling))
        before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        metrics = t.rl_step(batch)
        moves[scaling] = sum(float((p.detach() - before[n]).abs().sum()) for n, p in t.model.named_parameters())
        ess = metrics["is/ess"]
    assert 0 < ess < 0.9 and metrics["optim/lr_scale"] == pytest.approx(ess ** 0.5)
    assert moves[True] / moves[False] == pytest.approx(ess ** 0.5, rel=1e-3)


def test_split_contiguous_keeps_order_and_balances_tokens():
    from moerl.train.batching import split_contiguous

    batch = samples(10)
    runs = split_contiguous(batch, 3)
    assert [s for run in runs for s in run] == batch and len(runs) == 3
    tokens = [sum(positions(s) for s in run) for run in runs]
    assert max(tokens) - min(tokens) <= 2 * max(positions(s) for s in batch)
    assert split_contiguous(batch[:2], 4)[2:] == [[], []] and split_contiguous(batch, 1) == [batch]
