"""Watching the rollout/trainer mismatch: behaviour KL over a bound is said at once, once per episode.

`is/behaviour_kl` (moerl/train/loss.py) is KL(behaviour || trainer) per token over a step's samples: how far
the policy that sampled them is from the one the trainer starts its step from. Staleness raises it a little;
numerics alone keep it near 1e-4 in bf16. Far above that, the trainer is learning from samples of another
policy: weight sync delivering wrong bytes (CUDA IPC once handed the engine another bucket's bytes on every
other version: ~10 nats per token), engine and trainer computing different functions, or routing replay off.
A run whose KL passes `train.behaviour_kl_bound` says so on the console and in error.log; once per episode
(the first step over the bound, and again when it has stayed under it for `quiet_steps` steps), so a bad run is
seen on its first step without a line every step. An async run whose policy moves fast drifts around a bound
from step to step (on an H200 at lr 3e-5, max_staleness 2: 0.05-0.25 every few steps): one episode. The default
bound, 0.2, sits above the demo's async drift (peaks near 0.1) and far below a weight-sync bug (~10 nats).
"""

from __future__ import annotations

from typing import Callable, Mapping

KEY = "is/behaviour_kl"

CAUSES = ("likely causes: weight sync handing the engine wrong bytes (try weights.transport=object_store and "
          "compare), rollout and trainer computing different functions (model.dtype, kernels, "
          "model.routing_replay=false)")
DRIFT = ("; with stale samples also a policy that moves too far per step for train.max_staleness (lower "
         "train.optim.lr or train.max_staleness)")


class BehaviourKLWatch:
    """Feed it every RL step's metrics; it calls `warn(text)` when KL passes `bound` and when it comes back."""

    def __init__(self, bound: float, warn: Callable[[str], None], quiet_steps: int = 20) -> None:
        self.bound, self.warn, self.quiet_steps = bound, warn, quiet_steps
        self.episodes = 0  # passages over the bound so far
        self._start: int | None = None  # first step of the current episode
        self._peak = 0.0
        self._over = 0  # steps over the bound in the current episode
        self._under = 0  # steps under it in a row since the last one over

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        kl = metrics.get(KEY)
        if self.bound <= 0 or kl is None:
            return
        if kl > self.bound:
            if self._start is None:
                self._start, self._peak, self._over = step, kl, 0
                self.episodes += 1
                stale = metrics.get("staleness/mean") or 0.0
                self.warn(f"behaviour KL {kl:.3g} per token at step {step} is over train.behaviour_kl_bound="
                          f"{self.bound:g}: the samples were drawn by another policy than the trainer's "
                          f"(importance weights {metrics.get('is/weight_min', float('nan')):.3g}.."
                          f"{metrics.get('is/weight_max', float('nan')):.3g}, staleness/mean {stale:.2f}); "
                          f"{CAUSES}{DRIFT if stale > 0 else ''}")
            self._peak, self._over, self._under = max(self._peak, kl), self._over + 1, 0
        elif self._start is not None:
            self._under += 1
            if self._under >= self.quiet_steps:
                self.warn(f"behaviour KL back under {self.bound:g} for {self._under} steps at step {step}; "
                          f"steps {self._start}-{step - self._under}: {self._over} over it (peak {self._peak:.3g})")
                self._start = None
