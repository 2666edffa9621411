"""The RL policy loss: GRPO group advantages and a PPO-clip objective for off-policy (asynchronous) samples.

Shape legend: B sequences, T positions (completion tokens, right-padded; `mask_BT` is True on real tokens),
G samples per group (one prompt sampled G times), N groups.

Three policies appear per token (asynchronous RL, AReaL's "decoupled PPO"):

* current   pi_theta   `logprobs_BT`            the trainer's log-probs now, with grad;
* proximal  pi_prox    `proximal_logprobs_BT`   the trainer's log-probs at the start of this step (no grad): a
                                                 no-grad forward before the step's first update, or, with one
                                                 update per step, `logprobs_BT.detach()` (the same numbers);
* behaviour mu         `behaviour_logprobs_BT`  what the rollout engine reported when it sampled the token,
                                                 possibly several policy versions old.

Per valid token, with A the sequence's advantage and w = pi_prox / mu the off-policy weight:

    trust_region   ratio r                  clipped?   weight c per is_correction
    behaviour      pi_theta / mu            yes        none: 1; mask, m2po: 0 or 1 (the token dropped or kept)
    proximal       pi_theta / pi_prox       yes        tis: min(w, is_cap); mask, m2po: w or 0; none: 1
    none           pi_theta / sg(pi_theta)  no         as proximal (r is 1 with the gradient of log pi_theta)

    surr = min(r * A, clip(r, 1 - clip_eps_low, 1 + clip_eps_high) * A)          PPO's pessimistic bound
    surr = max(surr, clip_ratio_c * A) where A < 0                                 dual clip (0 = off)
    loss = -c * surr
           + kl_coef * (exp(ref - logprobs) - (ref - logprobs) - 1)              k3 estimator of KL(pi_theta || pi_ref)
           - entropy_coef * entropy

`behaviour` bounds every update's drift from the policy that sampled the tokens: a token whose ratio already left
the band on the side its advantage pushes gets no gradient. `proximal` bounds each update's drift from the step's
start and corrects the staleness by w, so it acts from the second update of a step on (`train.minibatches`).
`mask` keeps tokens with is_mask_low <= w <= is_cap; `m2po` keeps the tokens whose (log w)^2 is at most
`m2_cutoff`, the value `m2po_cutoff` finds over the whole step (M2PO, arXiv 2510.01161: the largest second moments
are dropped until the mean of the rest is <= m2_threshold); without one given, this batch's own.

The weight multiplies the policy-gradient term only; the KL and entropy terms and the normaliser count every
valid token, so the denominator of the loss depends on the mask alone (what `token_count` returns), never on
the log-probs, and ranks can agree on it before the forward pass.

Aggregation over the valid tokens:

    token-mean           sum over all valid tokens of the batch / number of valid tokens
    seq-mean-token-sum   per sequence: sum over its tokens; then mean over the non-empty sequences
    seq-mean-token-mean  per sequence: mean over its tokens; then mean over the non-empty sequences

Padding positions may hold any value (0, -inf, NaN): every input is replaced by 0 there before any arithmetic,
so they contribute neither to the loss nor (as NaN) to the gradient; all-masked rows are skipped.

Data parallel: pass `global_tokens` (token-mean) or `global_seqs` (seq-* variants), the sum over ranks of
`token_count(mask_BT)` / `sequence_count(mask_BT)`. Each rank's loss is then its share of the global loss, and
SUMMING the per-rank gradients (all-reduce SUM, not DDP's average) gives exactly the single-process gradient of
the whole batch. The loss value reported is likewise the rank's share.

Health statistics: `is/ess` is the effective sample size of the weights w over the batch's valid tokens,
(sum w)^2 / (n sum w^2), 1 on-policy and towards 1/n when a few tokens carry all the weight; `is/w_sum` and
`is/w_sq_sum` are its sums, which add up over micro-batches and ranks (`effective_sample_size`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from moerl.train.config import LossConfig

__all__ = [
    "LossConfig",
    "effective_sample_size",
    "group_advantages",
    "m2po_cutoff",
    "off_policy_log_weights",
    "policy_loss",
    "sequence_count",
    "token_count",
]

# exp() of log-weights beyond this is clamped: keeps the IS statistics finite when the behaviour log-prob of a
# token is absurdly low (e^20 ~ 5e8, far above any sensible is_cap, so truncation/masking are unaffected).
_MAX_LOG_WEIGHT = 20.0


# ------------------------------------------------------------------------------------------ advantages
def group_advantages(rewards_G_or_BG: Tensor, normalize_std: bool, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: reward minus its group's mean, optionally divided by the group's std (unbiased=False).

    `rewards_G_or_BG` is [G] (one group) or [N, G] (N groups of G); the result has the same shape, float32 (or
    the input's float dtype if wider). Groups whose rewards are all equal get exactly zero advantage (no NaN,
    no rounding noise blown up by the division). Flatten [N, G] -> [N*G] for `policy_loss`'s advantages_B.
    """
    if rewards_G_or_BG.dim() not in (1, 2):
        raise ValueError(f"rewards must be [G] or [N, G], got shape {tuple(rewards_G_or_BG.shape)}")
    if rewards_G_or_BG.shape[-1] == 0:
        raise ValueError("rewards must have at least one sample per group (G >= 1)")
    r_NG = rewards_G_or_BG if rewards_G_or_BG.dim() == 2 else rewards_G_or_BG.unsqueeze(0)
    dtype = torch.promote_types(r_NG.dtype, torch.float32) if r_NG.is_floating_point() else torch.float32
    r_NG = r_NG.to(dtype)
    adv_NG = r_NG - r_NG.mean(dim=-1, keepdim=True)
    if normalize_std:
        adv_NG = adv_NG / (r_NG.std(dim=-1, keepdim=True, unbiased=False) + eps)
    constant_N1 = (r_NG == r_NG[:, :1]).all(dim=-1, keepdim=True)
    adv_NG = torch.where(constant_N1, torch.zeros_like(adv_NG), adv_NG)
    return adv_NG if rewards_G_or_BG.dim() == 2 else adv_NG.squeeze(0)


# ------------------------------------------------------------------------------------------ counting
def token_count(mask_BT: Tensor) -> int:
    """Valid (completion) tokens in the batch; all-reduce SUM it across ranks for `global_tokens`."""
    return int(mask_BT.bool().sum().item())


def sequence_count(mask_BT: Tensor) -> int:
    """Sequences with at least one valid token; all-reduce SUM it across ranks for `global_seqs`."""
    return int(mask_BT.bool().any(dim=-1).sum().item())


# ------------------------------------------------------------------------------------------ off-policy statistics
def off_policy_log_weights(proximal_logprobs_N: Tensor, behaviour_logprobs_N: Tensor) -> Tensor:
    """log w = log pi_prox - log mu per token, clamped to +-_MAX_LOG_WEIGHT (what `policy_loss` uses)."""
    return (proximal_logprobs_N.double() - behaviour_logprobs_N.double()).clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT)


def m2po_cutoff(log_w_N: Tensor, threshold: float) -> float:
    """M2PO's mask as one number: the largest (log w)^2 kept. The tokens' second moments sorted ascending, the kept
    ones are the longest prefix whose mean is <= `threshold` (prefix means of sorted values never decrease, so
    this drops exactly the largest ones, fewest first). inf: every token kept; -1: none (even the smallest is
    over). Tokens tied with the cutoff beyond the prefix are kept too (ties of float second moments are rare).
    Deterministic: every rank computes it from the same gathered values."""
    m2_N = log_w_N.double().reshape(-1).square().sort().values
    if m2_N.numel() == 0:
        return math.inf
    means_N = m2_N.cumsum(0) / torch.arange(1, m2_N.numel() + 1, dtype=m2_N.dtype, device=m2_N.device)
    kept = int((means_N <= threshold).sum())
    if kept == m2_N.numel():
        return math.inf
    return float(m2_N[kept - 1]) if kept > 0 else -1.0


def effective_sample_size(w_sum: float, w_sq_sum: float, n: float) -> float:
    """(sum w)^2 / (n sum w^2), in (0, 1]; 1.0 for no tokens (nothing to down-weight)."""
    return w_sum * w_sum / (n * w_sq_sum) if n > 0 and w_sq_sum > 0 else 1.0


# ------------------------------------------------------------------------------------------ loss
def policy_loss(
    logprobs_BT: Tensor,
    proximal_logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    config: LossConfig,
    ref_logprobs_BT: Tensor | None = None,
    entropy_BT: Tensor | None = None,
    *,
    global_tokens: int | None = None,
    global_seqs: int | None = None,
    m2_cutoff: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped, off-policy-corrected policy loss with optional k3 KL and entropy terms (see module doc).

    `advantages_B` is [B] (one advantage per sequence) or [B, T] (per token). `mask_BT` is bool or 0/1.
    `global_tokens` (token-mean) / `global_seqs` (seq-* aggregations): the normaliser summed over all
    data-parallel ranks; None = this batch's own count. The one not matching `config.aggregation` is ignored.
    `m2_cutoff`: M2PO's cutoff over the whole step (`m2po_cutoff`); None = this batch's own.
    Returns a scalar loss (float32; float64 for float64 inputs) differentiable w.r.t. `logprobs_BT` and
    `entropy_BT`, and python-float metrics: local means over this rank's valid tokens (0.0 when there are none).
    """
    config.validate()
    if logprobs_BT.dim() != 2:
        raise ValueError(f"logprobs_BT must be [B, T], got shape {tuple(logprobs_BT.shape)}")
    B, T = logprobs_BT.shape
    for name, t in (("proximal_logprobs_BT", proximal_logprobs_BT), ("behaviour_logprobs_BT", behaviour_logprobs_BT),
                    ("mask_BT", mask_BT), ("ref_logprobs_BT", ref_logprobs_BT), ("entropy_BT", entropy_BT)):
        if t is not None and t.shape != logprobs_BT.shape:
            raise ValueError(f"{name} must have shape {(B, T)} like logprobs_BT, got {tuple(t.shape)}")
    if config.kl_coef > 0 and ref_logprobs_BT is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logprobs_BT")
    if config.entropy_coef > 0 and entropy_BT is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} needs entropy_BT")
    if advantages_B.shape not in ((B,), (B, T)):
        raise ValueError(f"advantages_B must be [B] or [B, T] = {(B,)} or {(B, T)}, got {tuple(advantages_B.shape)}")

    mask = mask_BT.bool()
    dtype = torch.promote_types(logprobs_BT.dtype, torch.float32)  # bf16 -> fp32; fp64 stays
    zero = logprobs_BT.new_zeros((), dtype=dtype)

    def clean(t: Tensor) -> Tensor:  # exactly 0 at padding, whatever was there: no NaN leaks into the gradient
        return torch.where(mask, t.to(dtype), zero)

    lp = clean(logprobs_BT)
    prox = clean(proximal_logprobs_BT.detach())
    beh = clean(behaviour_logprobs_BT.detach())
    adv = advantages_B.detach()
    adv = clean(adv.unsqueeze(1).expand(B, T) if adv.dim() == 1 else adv)

    # The off-policy weight w = pi_prox / mu and which tokens the correction keeps.
    log_w = (prox - beh).clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT)
    w_raw = torch.exp(log_w)
    keep = mask
    if config.is_correction == "mask":
        keep = mask & (w_raw >= config.is_mask_low) & (w_raw <= config.is_cap)
    elif config.is_correction == "m2po":
        cutoff = m2po_cutoff(log_w[mask], config.m2_threshold) if m2_cutoff is None else m2_cutoff
        keep = mask & (log_w.square() <= cutoff)
    if config.trust_region == "behaviour":  # the ratio carries the weight: c only keeps or drops
        w = keep.to(dtype)
    elif config.is_correction == "tis":
        w = w_raw.clamp(max=config.is_cap)
    elif config.is_correction == "none":
        w = torch.ones_like(w_raw)
    else:
        w = torch.where(keep, w_raw, zero)

    lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    base = {"behaviour": beh, "proximal": prox, "none": lp.detach()}[config.trust_region]
    ratio = torch.exp(lp - base)
    if config.trust_region == "none":
        surr = ratio * adv
    else:
        surr = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
        if config.clip_ratio_c > 0:
            surr = torch.where(adv < 0, torch.maximum(surr, config.clip_ratio_c * adv), surr)

    pg_tok = -w * surr
    loss_tok = pg_tok
    kl_tok = None
    if ref_logprobs_BT is not None:
        d = clean(ref_logprobs_BT.detach()) - lp
        kl_tok = torch.exp(d) - d - 1.0
        if config.kl_coef != 0.0:
            loss_tok = loss_tok + config.kl_coef * kl_tok
    ent_tok = None
    if entropy_BT is not None:
        ent_tok = clean(entropy_BT)
        if config.entropy_coef != 0.0:
            loss_tok = loss_tok - config.entropy_coef * ent_tok

    loss = _aggregate(loss_tok, mask, config.aggregation, global_tokens, global_seqs)

    with torch.no_grad():  # every statistic as a 0-d tensor, then one host transfer (one sync on GPU)
        m = mask.to(dtype)
        n = m.sum()
        inv_n = 1.0 / n.clamp(min=1.0)
        has = n > 0

        def mean(t: Tensor) -> Tensor:
            return (t.to(dtype) * m).sum() * inv_n

        def extreme(t: Tensor, fn) -> Tensor:  # max/min over valid tokens, 0 when there are none
            fill = -math.inf if fn is torch.amax else math.inf
            return torch.where(has, fn(torch.where(mask, t, fill)), zero)

        clipped = config.trust_region != "none"
        masked = mask & ~keep
        truncated = (w_raw > config.is_cap) & mask if config.is_correction == "tis" else torch.zeros_like(mask)
        clip_low = (adv < 0) & (ratio < lo) & mask & clipped
        clip_high = (adv > 0) & (ratio > hi) & mask & clipped
        dual = (adv < 0) & (ratio > config.clip_ratio_c) & mask & clipped & (config.clip_ratio_c > 0)
        kl_beh = w_raw - 1.0 - log_w  # k3, samples from mu, w = pi_prox/mu: E_mu[w - 1 - log w] = KL(mu || pi_prox)
        w_sum, w_sq_sum = (w_raw * m).sum(), (w_raw.square() * m).sum()
        stats = {
            "loss/policy": loss.detach(),
            "loss/pg": _aggregate(pg_tok, mask, config.aggregation, global_tokens, global_seqs),
            "policy/clip_frac": mean(clip_low | clip_high | dual),
            "policy/clip_frac_low": mean(clip_low),
            "policy/clip_frac_high": mean(clip_high),
            "policy/dual_clip_frac": mean(dual),
            "policy/ratio_mean": mean(ratio),
            "policy/ratio_max": extreme(ratio, torch.amax),
            "is/weight_mean": mean(w_raw),
            "is/weight_max": extreme(w_raw, torch.amax),
            "is/weight_min": extreme(w_raw, torch.amin),
            "is/weight_used_mean": mean(w),
            "is/truncated_frac": mean(truncated),
            "is/masked_frac": mean(masked),
            "is/masked_tokens": masked.sum(),
            "is/behaviour_kl": mean(kl_beh),
            "is/ess": torch.where(has & (w_sq_sum > 0), w_sum.square() / (n * w_sq_sum).clamp(min=1e-300),
                                  torch.ones((), dtype=dtype, device=n.device)),
            "is/w_sum": w_sum,
            "is/w_sq_sum": w_sq_sum,
            "tokens": n,
            "sequences": mask.any(dim=-1).sum(),
        }
        if kl_tok is not None:
            stats["loss/kl_ref"] = mean(kl_tok)
        if ent_tok is not None:
            stats["policy/entropy"] = mean(ent_tok)
        values = torch.stack([v.to(torch.float64) for v in stats.values()]).tolist()
        metrics = dict(zip(stats, values))
    return loss, metrics


def _aggregate(loss_BT: Tensor, mask_BT: Tensor, aggregation: str,
               global_tokens: int | None, global_seqs: int | None) -> Tensor:
    """Reduce per-token losses (already 0 at padding) to a scalar; see the module doc. Never NaN."""
    m = mask_BT.to(loss_BT.dtype)
    if aggregation == "token-mean":
        return (loss_BT * m).sum() / _normaliser("global_tokens", global_tokens, m.sum())
    lengths_B = m.sum(dim=-1)
    seq_B = (loss_BT * m).sum(dim=-1)
    if aggregation == "seq-mean-token-mean":
        seq_B = seq_B / lengths_B.clamp(min=1.0)  # empty rows: 0 / 1 = 0
    elif aggregation != "seq-mean-token-sum":
        raise ValueError(f"unknown aggregation {aggregation!r}")
    return seq_B.sum() / _normaliser("global_seqs", global_seqs, (lengths_B > 0).to(m.dtype).sum())


def _normaliser(name: str, global_count: int | None, local: Tensor) -> Tensor | float:
    """The local count as a tensor (no host sync), or the given global count after a sanity check."""
    if global_count is None:
        return local.clamp(min=1.0)
    if global_count < int(local):
        raise ValueError(f"{name}={global_count} is smaller than this rank's own count {int(local)}")
    return float(max(global_count, 1))
