"""Config sections of training: the policy loss (`train.loss`) and the optimizer (`train.optim`).

Torch-free (stdlib and `moerl.checks` only): `moerl.config` nests these dataclasses in `TrainConfig`, so they
are loaded from TOML and `--train.loss.X=...` / `--train.optim.X=...` overrides like every other section, and
handed as they are to `moerl.train.loss.policy_loss` and `moerl.train.trainer.PolicyTrainer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from moerl.checks import require

__all__ = ["Aggregation", "ISCorrection", "LossConfig", "OptimConfig", "TrustRegion"]

ISCorrection = Literal["tis", "mask", "m2po", "none"]
TrustRegion = Literal["behaviour", "proximal", "none"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


def _is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class LossConfig:
    trust_region: TrustRegion = "behaviour"
    """the policy the PPO clip bounds each update against (moerl/train/loss.py): "behaviour" = the rollout's log-
    probs (verl's and slime's clip when they do not recompute); "proximal" = the policy at the start of the step,
    one no-grad forward per step (AReaL's decoupled PPO; needs train.minibatches >= 2, else its ratio is always
    1); "none" = no clip (truncated-IS policy gradient, the objective before the trust region came)
    """
    clip_eps_low: float = 0.2
    """PPO clip: ratio lower bound is 1 - clip_eps_low"""
    clip_eps_high: float = 0.28
    """PPO clip: ratio upper bound is 1 + clip_eps_high (DAPO clip-higher)"""
    clip_ratio_c: float = 3.0
    """dual clip (Ye et al. 2020, verl's clip_ratio_c): a token of negative advantage contributes at most
    clip_ratio_c x |A|, so a ratio far above 1 cannot push its token down without bound; 0 = off, else > 1
    """
    is_correction: ISCorrection = "none"
    """off-policy correction by the weight w = step-start / behaviour per token: "tis" truncates it at is_cap
    (trust_region proximal or none), "mask" drops tokens whose w leaves [is_mask_low, is_cap], "m2po" drops the
    tokens of largest (log w)^2 until their mean over the step is <= m2_threshold (M2PO), "none" leaves it out
    """
    is_cap: float = 2.0
    """TIS truncation cap; upper bound of the band kept by "mask"."""
    is_mask_low: float = 0.5
    """lower bound of the band kept by "mask"."""
    m2_threshold: float = 0.04
    """"m2po": the bound on the step's mean (log w)^2 (M2PO's tau)"""
    ess_lr_scaling: bool = False
    """VCPO: each optimizer update's learning rate times sqrt(ESS) of its tokens' weights w, ESS = (sum w)^2 / (n
    sum w^2) in (0, 1]: a step whose few tokens carry most of the weight moves the policy less
    """
    kl_coef: float = 0.0
    """weight of the k3 KL to the reference policy; 0 = off"""
    aggregation: Aggregation = "token-mean"
    """how per-token losses are averaged"""
    normalize_adv_std: bool = True
    """GRPO: divide group-centred rewards by the group std"""
    entropy_coef: float = 0.0
    """entropy bonus weight; 0 = off"""

    def validate(self) -> None:
        """Raise ValueError (moerl.checks.CheckFailed) naming the offending field.

        The messages leave out the value: the config loader appends ", got <value>" to them.
        """
        for name in ("clip_eps_low", "clip_eps_high", "clip_ratio_c", "is_cap", "is_mask_low", "m2_threshold",
                     "kl_coef", "entropy_coef"):
            require(_is_finite_number(getattr(self, name)), name, "must be a finite number")
        require(self.trust_region in get_args(TrustRegion), "trust_region",
                f"must be one of {list(get_args(TrustRegion))}")
        require(0.0 <= self.clip_eps_low < 1.0, "clip_eps_low", "must be in [0, 1)")
        require(self.clip_eps_high >= 0.0, "clip_eps_high", "must be >= 0")
        require(self.clip_ratio_c == 0 or self.clip_ratio_c > 1.0, "clip_ratio_c", "must be 0 (off) or > 1")
        require(self.is_correction in get_args(ISCorrection), "is_correction",
                f"must be one of {list(get_args(ISCorrection))}")
        require(not (self.trust_region == "behaviour" and self.is_correction == "tis"), "is_correction",
                "'tis' truncates a weight that trust_region 'behaviour' does not apply (its ratio current/behaviour "
                "is clipped already): use 'none', 'mask' or 'm2po', or trust_region 'proximal'")
        require(self.is_cap >= 1.0, "is_cap", "must be >= 1 (on-policy weight 1 must pass)")
        require(0.0 <= self.is_mask_low <= 1.0, "is_mask_low", "must be in [0, 1]")
        require(self.m2_threshold > 0.0, "m2_threshold", "must be > 0")
        require(isinstance(self.ess_lr_scaling, bool), "ess_lr_scaling", "must be a bool")
        require(self.kl_coef >= 0.0, "kl_coef", "must be >= 0")
        require(self.entropy_coef >= 0.0, "entropy_coef", "must be >= 0")
        require(self.aggregation in get_args(Aggregation), "aggregation",
                f"must be one of {list(get_args(Aggregation))}")
        require(isinstance(self.normalize_adv_std, bool), "normalize_adv_std", "must be a bool")

    def needs_step_start(self, minibatches: int) -> bool:
        """Whether a step needs the policy's log-probs at its start before its first update: with several updates
        (the later ones see a moved policy) or for M2PO's mask (its bound is over the whole step's tokens)."""
        return minibatches > 1 or self.is_correction == "m2po"


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """AdamW learning rate (the peak, reached after the warmup)"""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay; 0 = off"""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2): decay of the gradient moment estimates"""
    grad_clip: float = 1.0
    """max global gradient norm; 0 = off (the trainer clips only when > 0)"""
    warmup_steps: int = 0
    """linear learning-rate warmup over this many optimizer steps; 0 = none"""

    def validate(self) -> None:
        """Raise ValueError (moerl.checks.CheckFailed) naming the offending field (the loader adds the value)."""
        require(_is_finite_number(self.lr) and self.lr > 0, "lr", "must be a finite number > 0")
        require(_is_finite_number(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(len(self.betas) == 2 and all(_is_finite_number(b) and 0 <= b < 1 for b in self.betas), "betas",
                "must be two numbers, each in [0, 1)")
        require(isinstance(self.grad_clip, (int, float)) and not isinstance(self.grad_clip, bool)
                and self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 = off)")
        require(isinstance(self.warmup_steps, int) and not isinstance(self.warmup_steps, bool)
                and self.warmup_steps >= 0, "warmup_steps", "must be an integer >= 0")
