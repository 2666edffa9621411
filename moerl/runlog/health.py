"""Training health: the signs that come before an RL run collapses, said when they start, once per episode.

Collapse in off-policy RL comes in a few shapes, each with a metric the trainer logs every step:

- entropy falls towards 0 (`policy/entropy`): the policy samples one answer per prompt, its groups stop differing,
  and learning stops where it stands (Marin: 12 of 12 correction runs on Qwen3-0.6B crossed a 0.1-nat floor;
  moerl's H200 run 2 went from 1.06 to 0.0007 nats in 33 steps);
- the importance weights concentrate (`is/ess`, (sum w)^2 / (n sum w^2)): a few stale tokens carry the step, its
  gradient is noisy and spikes (VCPO, arXiv 2602.17616, found ESS predicting collapse);
- the groups stop carrying a signal (`reward/all_equal_frac`): every sample of a prompt scores the same, so every
  advantage is 0 (too hard, too easy, or collapsed), or the reward itself is flat at one value for many steps
  (`reward/mean`), which is also how a reward function that returns a constant looks.

Each condition must hold for `window` steps in a row before it is said (one noisy step is not an episode), is said
once with its likely cause and the knob to turn, and is said to have ended once it has been clear for `window`
steps; a later episode is said again. Thresholds: `train.health` (moerl/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping


@dataclass
class _Episode:
    """One condition's state: steps in a row it held or was clear, and whether it is being reported."""

    held: int = 0
    clear: int = 0
    active_since: int | None = None


class HealthWatch:
    """Feed it every RL step's metrics; `warn(text)` hears each episode's start and end."""

    def __init__(self, config, warn: Callable[[str], None]) -> None:
        self.cfg, self.warn = config, warn
        self.episodes: dict[str, int] = {}  # condition -> episodes so far
        self._state = {name: _Episode() for name in ("entropy", "ess", "all_equal", "flat_reward")}
        self._flat_value: float | None = None
        self._flat_steps = 0

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        c = self.cfg
        entropy, ess = metrics.get("policy/entropy"), metrics.get("is/ess")
        all_equal, reward = metrics.get("reward/all_equal_frac"), metrics.get("reward/mean")
        self._update("entropy", step, c.entropy_floor > 0 and entropy is not None and entropy < c.entropy_floor,
                     lambda: f"policy entropy {entropy:.3g} nats per token is under train.health.entropy_floor="
                     f"{c.entropy_floor:g} for {c.window} steps at step {step} (reward {_fmt(reward)}, groups with "
                     f"all rewards equal {_pct(all_equal)}): the policy samples nearly one answer per prompt. Unless "
                     "the reward is at its best, it has collapsed; likely cause: updates too large for the data's "
                     "staleness. Lower train.optim.lr, keep a trust region (train.loss.trust_region), or add "
                     "train.loss.entropy_coef", "entropy")
        self._update("ess", step, c.ess_floor > 0 and ess is not None and ess < c.ess_floor,
                     lambda: f"effective sample size of the importance weights {ess:.3g} is under "
                     f"train.health.ess_floor={c.ess_floor:g} for {c.window} steps at step {step} (staleness "
                     f"{_fmt(metrics.get('staleness/mean'))}, behaviour KL {_fmt(metrics.get('is/behaviour_kl'))}, "
                     f"weights {_fmt(metrics.get('is/weight_min'))}..{_fmt(metrics.get('is/weight_max'))}): a few "
                     "tokens carry most of each step, whose gradient is noisy. Likely cause: samples too stale for "
                     "how fast the policy moves. Lower train.max_staleness or train.optim.lr, or set "
                     "train.loss.ess_lr_scaling=true (VCPO) or train.loss.is_correction='m2po'", "ESS")
        self._update("all_equal", step, c.all_equal_max < 1 and all_equal is not None and all_equal > c.all_equal_max,
                     lambda: f"{_pct(all_equal)} of groups have all rewards equal (no gradient) for {c.window} steps "
                     f"at step {step}, over train.health.all_equal_max={c.all_equal_max:g} (reward {_fmt(reward)}, "
                     f"entropy {_fmt(entropy)}): the prompts are too hard or too easy for the policy now, or it "
                     "collapsed. Set train.dynamic_sampling=true, raise rollout.group_size or rollout.temperature, "
                     "or change the task's difficulty", "groups without signal")
        if reward is not None:
            self._flat_steps = self._flat_steps + 1 if reward == self._flat_value else 1
            self._flat_value = reward
        flat = c.flat_reward_steps > 0 and self._flat_steps >= c.flat_reward_steps
        self._update("flat_reward", step, flat,
                     lambda: f"reward/mean has been {_fmt(reward)} on every one of the last {self._flat_steps} steps "
                     f"at step {step} (train.health.flat_reward_steps={c.flat_reward_steps}): a reward function "
                     "that returns one value for every completion (check the task's reward on a few completions: "
                     "trajectories.jsonl), or a policy that collapsed onto one answer. Nothing is learned meanwhile",
                     "flat reward", window=1)

    def _update(self, name: str, step: int, holds: bool, text: Callable[[], str], label: str,
                window: int | None = None) -> None:
        state, window = self._state[name], window or self.cfg.window
        if holds:
            state.held, state.clear = state.held + 1, 0
            if state.active_since is None and state.held >= window:
                state.active_since = step - window + 1
                self.episodes[name] = self.episodes.get(name, 0) + 1
                self.warn(text())
        else:
            state.held, state.clear = 0, state.clear + 1
            if state.active_since is not None and state.clear >= self.cfg.window:
                self.warn(f"{label} back to normal for {state.clear} steps at step {step} (it held from step "
                          f"{state.active_since} to {step - state.clear})")
                state.active_since = None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
