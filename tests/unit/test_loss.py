"""The RL loss: GRPO advantages, decoupled PPO clip, IS correction, KL/entropy terms, aggregation, DDP normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from moerl.train.loss import (LossConfig, effective_sample_size, group_advantages, m2po_cutoff, policy_loss,
                              sequence_count, token_count)

AGGREGATIONS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


# ----------------------------------------------------------------------------------------- helpers
class LinearPolicy:
    """logits = x @ W: a tiny differentiable 'policy' over V tokens, fixed features and sampled tokens."""

    def __init__(self, B: int = 4, T: int = 5, D: int = 3, V: int = 6, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.W = torch.randn(D, V, generator=g, dtype=torch.float64).requires_grad_(True)
        self.x_BTD = torch.randn(B, T, D, generator=g, dtype=torch.float64)
        self.tokens_BT = torch.randint(0, V, (B, T), generator=g)
        lengths = torch.tensor([5, 2, 0, 3])[:B]  # unequal, one empty row
        self.mask_BT = torch.arange(T)[None, :] < lengths[:, None]

    def logprobs(self, rows: slice = slice(None)) -> torch.Tensor:
        logits = self.x_BTD[rows] @ self.W
        return torch.log_softmax(logits, -1).gather(-1, self.tokens_BT[rows, :, None]).squeeze(-1)

    def grad(self, loss: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(loss, self.W)
        return g


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


# ----------------------------------------------------------------------------------------- advantages
def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0], [3.0, 3.0, 3.0, 3.0]])
    adv = group_advantages(rewards, normalize_std=False)
    assert adv.shape == (3, 4)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [-3.0, -1.0, 1.0, 3.0], [0.0] * 4]))

    adv = group_advantages(rewards, normalize_std=True, eps=0.0)
    std1, std2 = 0.5, math.sqrt(5.0)  # population std (unbiased=False)
    expected = torch.tensor([[0.5 / std1, -0.5 / std1, -0.5 / std1, 0.5 / std1],
                             [-3 / std2, -1 / std2, 1 / std2, 3 / std2], [0.0] * 4])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(adv[:2].std(-1, unbiased=False), torch.ones(2))


def test_group_advantages_constant_groups_are_exactly_zero():
    # 0.1 * 3 does not average back to exactly 0.1 in float: the residue must not be blown up by the std.
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.0, 0.0, 0.0], [-7.3, -7.3, -7.3]])
    for normalize in (True, False):
        adv = group_advantages(rewards, normalize_std=normalize)
        assert torch.equal(adv, torch.zeros_like(adv))
    assert torch.equal(group_advantages(torch.tensor([[5.0]]), True), torch.zeros(1, 1))  # G = 1


def test_group_advantages_one_group_and_int_rewards():
    adv = group_advantages(torch.tensor([0, 1, 1, 0]), normalize_std=True)
    assert adv.shape == (4,) and adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.zeros(2, 2, 2), True)


# ----------------------------------------------------------------------------------------- on-policy == vanilla PG
ON_POLICY_CONFIGS = [("behaviour", "none"), ("behaviour", "mask"), ("behaviour", "m2po"), ("proximal", "tis"),
                     ("proximal", "mask"), ("proximal", "m2po"), ("proximal", "none"), ("none", "tis"), ("none", "none")]


@pytest.mark.parametrize("trust_region,is_correction", ON_POLICY_CONFIGS)
def test_on_policy_gradient_is_vanilla_policy_gradient(trust_region, is_correction):
    pol = LinearPolicy()
    adv_B = torch.tensor([1.5, -0.7, 2.0, 0.3], dtype=torch.float64)
    cfg = LossConfig(trust_region=trust_region, is_correction=is_correction)
    lp = pol.logprobs()
    loss, metrics = policy_loss(lp, lp.detach(), lp.detach(), adv_B, pol.mask_BT, cfg)
    m = pol.mask_BT.double()
    vanilla = -(adv_B[:, None] * pol.logprobs() * m).sum() / m.sum()
    torch.testing.assert_close(pol.grad(loss), pol.grad(vanilla), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.double(), -(adv_B[:, None] * m).sum() / m.sum(), rtol=1e-6, atol=1e-6)
    assert metrics["policy/clip_frac"] == 0.0 and metrics["is/weight_mean"] == pytest.approx(1.0)
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0) and metrics["is/behaviour_kl"] == pytest.approx(0.0)
    assert metrics["is/ess"] == pytest.approx(1.0) and metrics["is/masked_frac"] == 0.0
    assert metrics["tokens"] == 10.0 and metrics["sequences"] == 3.0
    assert all(isinstance(v, float) for v in metrics.values())


def test_on_policy_seq_mean_token_mean_is_per_sequence_average():
    pol = LinearPolicy()
    adv_B = torch.tensor([1.5, -0.7, 2.0, 0.3], dtype=torch.float64)
    lp = pol.logprobs()
    loss, _ = policy_loss(lp, lp.detach(), lp.detach(), adv_B, pol.mask_BT,
                          LossConfig(aggregation="seq-mean-token-mean"))
    m = pol.mask_BT.double()
    lp2 = pol.logprobs()
    rows = [-(adv_B[b] * lp2[b] * m[b]).sum() / m[b].sum() for b in (0, 1, 3)]  # row 2 is empty: skipped
    torch.testing.assert_close(pol.grad(loss), pol.grad(sum(rows) / 3), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------- PPO clip
def test_clip_zeroes_gradient_on_the_right_side():
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, is_correction="none")
    r = torch.tensor([0.5, 0.79, 0.9, 1.1, 1.27, 1.5], dtype=torch.float64)
    lp = torch.zeros(2, 6, dtype=torch.float64, requires_grad=True)
    prox = -torch.log(r).expand(2, 6)  # ratio = exp(lp - prox) = r
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(2, 6, dtype=torch.bool)
    loss, metrics = policy_loss(lp, prox, prox, adv, mask, cfg)
    g = grad_of(loss, lp)
    n = 12
    # A > 0: only r > 1 + eps_high is clipped (flat); r below 1 - eps_low keeps its gradient (min picks r*A).
    expected_pos = torch.where(r > 1.28, 0.0, -r / n)
    # A < 0: only r < 1 - eps_low is clipped; large r keeps its (pessimistic) gradient.
    expected_neg = torch.where(r < 0.8, 0.0, r / n)
    torch.testing.assert_close(g[0], expected_pos, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g[1], expected_neg, rtol=1e-5, atol=1e-7)
    assert metrics["policy/clip_frac"] == pytest.approx(3 / 12)
    assert metrics["policy/clip_frac_high"] == pytest.approx(1 / 12)
    assert metrics["policy/clip_frac_low"] == pytest.approx(2 / 12)
    assert metrics["policy/ratio_mean"] == pytest.approx(float(r.mean()), rel=1e-5)
    assert metrics["policy/ratio_max"] == pytest.approx(1.5, rel=1e-5)


def test_clip_is_asymmetric():
    # r = 1.25 is inside [0.8, 1.28] (not clipped) but would be clipped by a symmetric 0.2.
    lp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    prox = torch.full((1, 1), -math.log(1.25), dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    adv = torch.ones(1, dtype=torch.float64)
    asym, _ = policy_loss(lp, prox, prox, adv, mask, LossConfig())
    sym, _ = policy_loss(lp, prox, prox, adv, mask, LossConfig(clip_eps_high=0.2))
    assert grad_of(asym, lp).item() == pytest.approx(-1.25, rel=1e-5)
    assert grad_of(sym, lp).item() == 0.0


# ----------------------------------------------------------------------------------------- IS correction
def _off_policy(ws):
    """lp = prox = 0, behaviour = -log w: ratio 1, decoupled IS weight w per token."""
    w = torch.tensor([ws], dtype=torch.float64)
    lp = torch.zeros_like(w, requires_grad=True)
    return lp, torch.zeros_like(w), -torch.log(w), torch.ones_like(w, dtype=torch.bool)


def test_tis_truncates_weights():
    ws = [0.25, 1.0, 3.0, 10.0]
    lp, prox, beh, mask = _off_policy(ws)
    adv = torch.tensor([2.0], dtype=torch.float64)
    loss, metrics = policy_loss(lp, prox, beh, adv, mask, LossConfig(trust_region="proximal", is_correction="tis",
                                                                        is_cap=2.0))
    used = torch.tensor([0.25, 1.0, 2.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(grad_of(loss, lp)[0], -used * 2.0 / 4, rtol=1e-5, atol=1e-7)
    assert loss.item() == pytest.approx(float(-(used * 2.0).mean()), rel=1e-5)
    assert metrics["is/truncated_frac"] == 0.5 and metrics["is/masked_frac"] == 0.0
    assert metrics["is/weight_max"] == pytest.approx(10.0, rel=1e-5)
    assert metrics["is/weight_min"] == pytest.approx(0.25, rel=1e-5)
    assert metrics["is/weight_mean"] == pytest.approx(sum(ws) / 4, rel=1e-5)
    assert metrics["is/weight_used_mean"] == pytest.approx(float(used.mean()), rel=1e-5)
    # k3 of KL(mu || pi_prox), samples from mu: mean(w - 1 - log w) > 0
    assert metrics["is/behaviour_kl"] == pytest.approx(sum(w - 1 - math.log(w) for w in ws) / 4, rel=1e-5)


def test_mask_mode_masks_and_counts():
    ws = [0.25, 0.5, 1.0, 2.0, 3.0]  # band [0.5, 2.0] is inclusive
    lp, prox, beh, mask = _off_policy(ws)
    adv = torch.tensor([1.0], dtype=torch.float64)
    cfg = LossConfig(trust_region="proximal", is_correction="mask", is_cap=2.0, is_mask_low=0.5)
    loss, metrics = policy_loss(lp, prox, beh, adv, mask, cfg)
    used = torch.tensor([0.0, 0.5, 1.0, 2.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(grad_of(loss, lp)[0], -used / 5, rtol=1e-5, atol=1e-7)  # still / all 5 tokens
    assert metrics["is/masked_frac"] == pytest.approx(2 / 5) and metrics["is/masked_tokens"] == 2.0
    assert metrics["is/truncated_frac"] == 0.0 and metrics["tokens"] == 5.0


def test_none_mode_ignores_behaviour():
    lp, prox, beh, mask = _off_policy([0.25, 3.0])
    loss, metrics = policy_loss(lp, prox, beh, torch.ones(1, dtype=torch.float64), mask,
                                LossConfig(trust_region="proximal", is_correction="none"))
    torch.testing.assert_close(grad_of(loss, lp)[0], torch.full((2,), -0.5, dtype=torch.float64))
    assert metrics["is/weight_max"] == pytest.approx(3.0, rel=1e-5)  # still reported as a diagnostic


def test_is_weight_does_not_touch_ratio_or_proximal_gradient():
    # proximal given with grad by mistake: it is detached; the weight multiplies r's gradient without a term of its own.
    prox = torch.tensor([[-0.1, 0.2]], dtype=torch.float64, requires_grad=True)
    lp = torch.tensor([[0.05, 0.1]], dtype=torch.float64, requires_grad=True)
    beh = torch.tensor([[0.3, -0.2]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = policy_loss(lp, prox, beh, torch.ones(1, dtype=torch.float64), mask,
                          LossConfig(trust_region="proximal", is_correction="tis"))
    g_lp, g_prox = torch.autograd.grad(loss, [lp, prox], allow_unused=True)
    assert g_prox is None or torch.all(g_prox == 0)
    r = torch.exp(lp.detach() - prox.detach())
    w = torch.exp(prox.detach() - beh).clamp(max=2.0)
    inside = (r >= 0.8) & (r <= 1.28)
    torch.testing.assert_close(g_lp, torch.where(inside, -w * r / 2, 0.0), rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------- KL and entropy
def test_kl_zero_at_reference_and_positive_elsewhere():
    pol = LinearPolicy()
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    cfg_kl = LossConfig(kl_coef=0.5)
    lp = pol.logprobs()
    base, _ = policy_loss(lp, lp.detach(), lp.detach(), adv, pol.mask_BT, LossConfig())
    g_base = pol.grad(base)
    lp = pol.logprobs()
    same, metrics = policy_loss(lp, lp.detach(), lp.detach(), adv, pol.mask_BT, cfg_kl, ref_logprobs_BT=lp.detach())
    assert metrics["loss/kl_ref"] == 0.0
    assert same.item() == pytest.approx(base.item())
    torch.testing.assert_close(pol.grad(same), g_base)

    lp = pol.logprobs()
    ref = lp.detach() + torch.randn(lp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    other, metrics = policy_loss(lp, lp.detach(), lp.detach(), adv, pol.mask_BT, cfg_kl, ref_logprobs_BT=ref)
    assert metrics["loss/kl_ref"] > 0
    assert other.item() > base.item()


def test_kl_gradient_pulls_towards_reference():
    lp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)  # token 0: lp above ref; token 1: below
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = policy_loss(lp, lp.detach(), lp.detach(), torch.zeros(1, dtype=torch.float64), mask,
                          LossConfig(kl_coef=0.3), ref_logprobs_BT=ref)
    g = grad_of(loss, lp)[0]
    assert g[0] > 0 and g[1] < 0  # gradient descent lowers lp towards ref on token 0, raises it on token 1
    torch.testing.assert_close(g, 0.3 * (1 - torch.exp(ref[0])) / 2, rtol=1e-5, atol=1e-7)


def test_entropy_bonus():
    lp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    ent = torch.tensor([[1.0, 2.0, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, metrics = policy_loss(lp, lp.detach(), lp.detach(), torch.zeros(1, dtype=torch.float64), mask,
                                LossConfig(entropy_coef=0.1), entropy_BT=ent)
    assert loss.item() == pytest.approx(-0.1 * 1.5)
    torch.testing.assert_close(grad_of(loss, ent), torch.tensor([[-0.05, -0.05, 0.0]], dtype=torch.float64))
    assert metrics["policy/entropy"] == pytest.approx(1.5)


# ----------------------------------------------------------------------------------------- aggregation
def _aggregation_batch():
    """Per-token loss -A_b (on-policy, ratio 1); lengths 1, 3, 0; padding full of NaN/-inf garbage."""
    mask = torch.tensor([[True, False, False], [True, True, True], [False, False, False]])
    lp = torch.where(mask, torch.zeros(3, 3, dtype=torch.float64), torch.tensor(-math.inf, dtype=torch.float64))
    lp.requires_grad_(True)
    prox = torch.where(mask, 0.0, torch.tensor(math.nan, dtype=torch.float64))
    beh = torch.where(mask, 0.0, torch.tensor(-math.inf, dtype=torch.float64))
    ref = torch.where(mask, 0.0, torch.tensor(math.nan, dtype=torch.float64))
    adv = torch.tensor([1.0, 3.0, 5.0], dtype=torch.float64)
    return lp, prox, beh, ref, adv, mask


@pytest.mark.parametrize("aggregation,expected", [("token-mean", -10 / 4), ("seq-mean-token-sum", -(1 + 9) / 2),
                                                  ("seq-mean-token-mean", -(1 + 3) / 2)])
def test_aggregation_variants_with_unequal_lengths_and_empty_row(aggregation, expected):
    lp, prox, beh, ref, adv, mask = _aggregation_batch()
    cfg = LossConfig(aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)
    loss, metrics = policy_loss(lp, prox, beh, adv, mask, cfg, ref_logprobs_BT=ref, entropy_BT=torch.zeros(3, 3))
    assert loss.item() == pytest.approx(expected)
    g = grad_of(loss, lp)
    assert torch.isfinite(g).all() and torch.all(g[~mask] == 0)
    assert all(math.isfinite(v) for v in metrics.values())


def test_all_masked_batch_is_zero_and_finite():
    for aggregation in AGGREGATIONS:
        lp = torch.full((2, 3), math.nan, dtype=torch.float64, requires_grad=True)
        mask = torch.zeros(2, 3, dtype=torch.bool)
        loss, metrics = policy_loss(lp, lp.detach(), lp.detach(), torch.ones(2), mask,
                                    LossConfig(aggregation=aggregation, is_correction="mask"))
        assert loss.item() == 0.0
        assert torch.equal(grad_of(loss, lp), torch.zeros(2, 3, dtype=torch.float64))
        assert metrics["is/ess"] == 1.0  # nothing to down-weight
        assert metrics["tokens"] == 0.0 and all(v == 0.0 for k, v in metrics.items() if k != "is/ess")


def test_token_level_advantages_and_float_mask():
    lp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    adv_BT = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    loss, _ = policy_loss(lp, lp.detach(), lp.detach(), adv_BT, torch.tensor([[1.0, 1.0]]), LossConfig())
    torch.testing.assert_close(grad_of(loss, lp), torch.tensor([[-0.5, 1.0]], dtype=torch.float64))


def test_bf16_inputs_give_float32_loss():
    lp = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach(), lp.detach(), torch.ones(2), torch.ones(2, 3, dtype=torch.bool), LossConfig())
    assert loss.dtype == torch.float32
    assert grad_of(loss, lp).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------- data parallel
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_global_normalisation_two_ranks_sum_to_single_process(aggregation):
    pol = LinearPolicy()
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    with torch.no_grad():
        lp0 = pol.logprobs()
    prox = lp0 + 0.2 * torch.randn(4, 5, generator=g, dtype=torch.float64)  # several minibatches per step
    beh = prox + 0.5 * torch.randn(4, 5, generator=g, dtype=torch.float64)  # stale rollout
    ref = lp0 + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    ent = torch.rand(4, 5, generator=g, dtype=torch.float64)
    cfg = LossConfig(aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01)

    single, _ = policy_loss(pol.logprobs(), prox, beh, adv, pol.mask_BT, cfg, ref, ent)
    g_single = pol.grad(single)

    ranks = [slice(0, 2), slice(2, 4)]  # rank 1 holds the empty row
    n_tok = sum(token_count(pol.mask_BT[s]) for s in ranks)
    n_seq = sum(sequence_count(pol.mask_BT[s]) for s in ranks)
    assert (n_tok, n_seq) == (token_count(pol.mask_BT), sequence_count(pol.mask_BT)) == (10, 3)
    total_grad, total_loss = torch.zeros_like(pol.W), 0.0
    for s in ranks:
        loss, _ = policy_loss(pol.logprobs(s), prox[s], beh[s], adv[s], pol.mask_BT[s], cfg, ref[s], ent[s],
                              global_tokens=n_tok, global_seqs=n_seq)
        total_grad += pol.grad(loss)
        total_loss += loss.item()
    torch.testing.assert_close(total_grad, g_single, rtol=1e-5, atol=1e-6)
    assert total_loss == pytest.approx(single.item(), rel=1e-5, abs=1e-6)


def test_global_tokens_smaller_than_local_is_an_error():
    lp = torch.zeros(1, 4, requires_grad=True)
    with pytest.raises(ValueError, match="global_tokens"):
        policy_loss(lp, lp.detach(), lp.detach(), torch.ones(1), torch.ones(1, 4, dtype=torch.bool),
                    LossConfig(), global_tokens=2)


# ----------------------------------------------------------------------------------------- validation
def test_default_config_validates():
    LossConfig().validate()


@pytest.mark.parametrize("field,value", [
    ("clip_eps_low", -0.1), ("clip_eps_low", 1.0), ("clip_eps_high", -0.01), ("clip_eps_high", math.nan),
    ("is_correction", "ratio"), ("is_cap", 0.9), ("is_cap", math.inf), ("is_mask_low", 1.5),
    ("is_mask_low", -0.1), ("kl_coef", -1.0), ("aggregation", "sum"), ("normalize_adv_std", "yes"),
    ("entropy_coef", -0.1), ("kl_coef", "0.1"),
])
def test_validate_names_the_field(field, value):
    cfg = LossConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        cfg.validate()
    lp = torch.zeros(1, 1, requires_grad=True)
    with pytest.raises(ValueError, match=field):
        policy_loss(lp, lp.detach(), lp.detach(), torch.ones(1), torch.ones(1, 1, dtype=torch.bool), cfg)


def test_shape_errors():
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="behaviour_logprobs_BT"):
        policy_loss(lp, lp.detach(), torch.zeros(2, 4), torch.ones(2), mask, LossConfig())
    with pytest.raises(ValueError, match="advantages_B"):
        policy_loss(lp, lp.detach(), lp.detach(), torch.ones(3), mask, LossConfig())


def test_coefficient_without_its_input_is_an_error():
    lp = torch.zeros(1, 2, requires_grad=True)
    args = (lp, lp.detach(), lp.detach(), torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        policy_loss(*args, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_BT"):
        policy_loss(*args, LossConfig(entropy_coef=0.1))


# ----------------------------------------------------------------------------------------- trust regions (issue 35)
VALID_CONFIGS = [("behaviour", "none"), ("behaviour", "mask"), ("behaviour", "m2po"), ("proximal", "tis"),
                 ("proximal", "mask"), ("proximal", "m2po"), ("proximal", "none"), ("none", "tis"), ("none", "none")]


def reference_token_loss(lp: float, prox: float, beh: float, a: float, cfg: LossConfig, cutoff: float) -> float:
    """One token's policy term written out from the module doc, in python floats (float64)."""
    log_w = max(-20.0, min(20.0, prox - beh))
    w = math.exp(log_w)
    keep = {"mask": cfg.is_mask_low <= w <= cfg.is_cap, "m2po": log_w * log_w <= cutoff}.get(cfg.is_correction, True)
    if cfg.trust_region == "behaviour":
        c = 1.0 if keep else 0.0
    else:
        c = {"tis": min(w, cfg.is_cap), "none": 1.0}.get(cfg.is_correction, w if keep else 0.0)
    if cfg.trust_region == "none":
        return -c * a * math.exp(lp - lp)  # the value; its gradient is -c * a * dlp (see the test)
    r = math.exp(lp - (beh if cfg.trust_region == "behaviour" else prox))
    surr = min(r * a, min(max(r, 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high) * a)
    if a < 0 and cfg.clip_ratio_c > 0:
        surr = max(surr, cfg.clip_ratio_c * a)
    return -c * surr


@pytest.mark.parametrize("trust_region,is_correction", VALID_CONFIGS)
def test_every_objective_matches_a_float64_reference_on_a_moved_policy(trust_region, is_correction):
    """A batch whose policy moved (current != proximal != behaviour, ratios well outside the band): value and
    gradient per token against the module doc's formulas written out per token; the clip acts wherever it may."""
    g = torch.Generator().manual_seed(3)
    B, T = 6, 7
    mask = torch.rand(B, T, generator=g) < 0.8
    beh = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    prox = beh + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.6  # stale samples: w spread over e^+-1
    lp = (prox + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5).requires_grad_(True)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    cfg = LossConfig(trust_region=trust_region, is_correction=is_correction, m2_threshold=0.1)
    loss, metrics = policy_loss(lp, prox, beh, adv, mask, cfg)
    grad = grad_of(loss, lp)
    n = int(mask.sum())
    log_w = (prox - beh)[mask]
    cutoff = m2po_cutoff(log_w, 0.1)
    eps = 1e-6
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                assert grad[b, t] == 0
                continue
            args = (float(prox[b, t]), float(beh[b, t]), float(adv[b]), cfg, cutoff)
            x = float(lp.detach()[b, t])
            if trust_region == "none":  # r = exp(lp - sg(lp)): d/dlp of -c * A * r is -c * A
                expected = reference_token_loss(x, *args) / n
            else:  # central difference of the float64 reference
                expected = (reference_token_loss(x + eps, *args) - reference_token_loss(x - eps, *args)) / (2 * eps * n)
            assert grad[b, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-8), (b, t)
    value = sum(reference_token_loss(float(lp.detach()[b, t]), float(prox[b, t]), float(beh[b, t]), float(adv[b]), cfg,
                                     cutoff) for b in range(B) for t in range(T) if mask[b, t]) / n
    assert loss.item() == pytest.approx(value, rel=1e-9)
    if trust_region != "none":
        assert metrics["policy/clip_frac"] > 0.05  # the clip acts on a moved policy
        assert (grad[mask] == 0).sum() >= metrics["policy/clip_frac"] * n - 1e-9  # and its tokens have no gradient
    else:
        assert metrics["policy/clip_frac"] == 0.0


def test_behaviour_trust_region_acts_where_the_proximal_one_with_one_update_cannot():
    """4dcea02 passed the current log-probs as the proximal policy: ratio 1, clip_frac 0 on every step. Against the
    behaviour policy the same stale batch is clipped, and the clipped tokens get exactly no gradient."""
    lp = torch.log(torch.tensor([[0.5, 0.9, 0.6, 0.2]], dtype=torch.float64)).requires_grad_(True)
    beh = torch.log(torch.tensor([[0.25, 0.8, 0.6, 0.5]], dtype=torch.float64))  # r = 2, 1.125, 1, 0.4
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.tensor([1.0], dtype=torch.float64)
    old, old_metrics = policy_loss(lp, lp.detach(), beh, adv, mask,
                                   LossConfig(trust_region="proximal", is_correction="tis"))
    assert old_metrics["policy/clip_frac"] == 0.0  # the objective of 4dcea02 never clips
    assert torch.all(grad_of(old, lp) != 0)
    new, metrics = policy_loss(lp, lp.detach(), beh, adv, mask, LossConfig(trust_region="behaviour"))
    g = grad_of(new, lp)[0]
    r = torch.tensor([2.0, 1.125, 1.0, 0.4], dtype=torch.float64)
    # A > 0: r = 2 is over 1.28 (no gradient); 0.4 is under 0.8 but the min keeps r * A (its gradient r * A)
    torch.testing.assert_close(g, torch.where(r > 1.28, 0.0, -r / 4), rtol=1e-9, atol=0)
    assert metrics["policy/clip_frac"] == 0.25 and metrics["policy/clip_frac_high"] == 0.25


def test_dual_clip_bounds_a_negative_advantage_token_with_a_large_ratio():
    lp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    beh = -torch.log(torch.tensor([[2.0, 3.5, 10.0]], dtype=torch.float64))  # r = 2, 3.5, 10
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    loss, metrics = policy_loss(lp, lp.detach(), beh, adv, mask, LossConfig(clip_ratio_c=3.0))
    # r = 2: the pessimistic PPO term r * A, gradient r / 3; r = 3.5 and 10: at most c * |A|, no gradient
    torch.testing.assert_close(grad_of(loss, lp)[0], torch.tensor([2 / 3, 0.0, 0.0], dtype=torch.float64))
    assert loss.item() == pytest.approx((2 + 3 + 3) / 3)
    assert metrics["policy/dual_clip_frac"] == pytest.approx(2 / 3)
    off, _ = policy_loss(lp, lp.detach(), beh, adv, mask, LossConfig(clip_ratio_c=0.0))
    assert off.item() == pytest.approx((2 + 3.5 + 10) / 3)


def test_behaviour_mask_drops_tokens_outside_the_band_and_keeps_the_ratio_elsewhere():
    lp = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    prox = torch.zeros(1, 4, dtype=torch.float64)
    beh = -torch.log(torch.tensor([[0.25, 0.9, 1.2, 3.0]], dtype=torch.float64))  # w = r = 0.25, 0.9, 1.2, 3
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, metrics = policy_loss(lp, prox, beh, torch.tensor([1.0], dtype=torch.float64), mask,
                                LossConfig(is_correction="mask", is_mask_low=0.5, is_cap=2.0))
    torch.testing.assert_close(grad_of(loss, lp)[0], torch.tensor([0.0, -0.9 / 4, -1.2 / 4, 0.0],
                                                                   dtype=torch.float64))
    assert metrics["is/masked_frac"] == 0.5


def test_m2po_cutoff_drops_the_largest_second_moments_until_the_mean_is_under_the_bound():
    log_w = torch.tensor([0.1, -0.1, 0.2, 0.5, -1.0], dtype=torch.float64)  # m2 = .01 .01 .04 .25 1
    assert m2po_cutoff(log_w, 1.0) == math.inf  # mean 0.262 <= 1: every token kept
    assert m2po_cutoff(log_w, 0.1) == pytest.approx(0.25)  # without 1.0: mean 0.0775
    assert m2po_cutoff(log_w, 0.05) == pytest.approx(0.04)  # without 0.25 too: mean 0.02
    assert m2po_cutoff(log_w, 0.001) == -1.0  # even the smallest is over: none kept
    assert m2po_cutoff(torch.zeros(0), 0.04) == math.inf
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # against greedy removal of the largest, one at a time
        values = torch.randn(int(torch.randint(1, 40, (1,), generator=g)), generator=g, dtype=torch.float64)
        tau = float(torch.rand(1, generator=g)) * 0.8
        kept = sorted(values.square().tolist())
        while kept and sum(kept) / len(kept) > tau:
            kept.pop()
        cutoff = m2po_cutoff(values, tau)
        assert sorted(v for v in values.square().tolist() if v <= cutoff) == kept


def test_m2po_in_the_loss_uses_the_steps_cutoff_when_given():
    lp = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    beh = -torch.tensor([[0.1, -0.2, 0.3, 1.5]], dtype=torch.float64)  # log w = prox - beh = 0.1 -0.2 0.3 1.5
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.tensor([1.0], dtype=torch.float64)
    cfg = LossConfig(trust_region="proximal", is_correction="m2po", m2_threshold=0.1)
    loss, metrics = policy_loss(lp, lp.detach(), beh, adv, mask, cfg)  # its own cutoff: 1.5 dropped
    w = torch.exp(torch.tensor([0.1, -0.2, 0.3, 0.0], dtype=torch.float64)) * torch.tensor([1, 1, 1, 0.0])
    torch.testing.assert_close(grad_of(loss, lp)[0], -w / 4)
    assert metrics["is/masked_frac"] == 0.25
    loss, metrics = policy_loss(lp, lp.detach(), beh, adv, mask, cfg, m2_cutoff=0.05)  # the step's: 0.3 too
    assert metrics["is/masked_frac"] == 0.5


def test_ess_by_hand_and_from_sums():
    lp, prox, beh, mask = _off_policy([0.5, 1.0, 4.0])
    _, metrics = policy_loss(lp, prox, beh, torch.tensor([1.0], dtype=torch.float64), mask, LossConfig())
    assert metrics["is/ess"] == pytest.approx(5.5 ** 2 / (3 * 17.25))
    assert metrics["is/w_sum"] == pytest.approx(5.5) and metrics["is/w_sq_sum"] == pytest.approx(17.25)
    assert effective_sample_size(5.5, 17.25, 3) == pytest.approx(metrics["is/ess"])
    assert effective_sample_size(0.0, 0.0, 0) == 1.0


@pytest.mark.parametrize("field,value", [("clip_ratio_c", 1.0), ("m2_threshold", 0.0), ("trust_region", "ppo")])
def test_new_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value}).validate()


def test_tis_with_the_behaviour_trust_region_is_refused():
    with pytest.raises(ValueError, match="is_correction.*'tis'"):
        LossConfig(trust_region="behaviour", is_correction="tis").validate()
