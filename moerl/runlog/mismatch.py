"""Watching the rollout/trainer mismatch: behaviour KL over a bound is said at once, once per episode.

`is/behaviour_kl` (moerl/train/loss.py) is KL(behaviour || trainer) per token over a step's samples: how far
the policy that sampled them is from the one the trainer starts its step from. Staleness raises it a little;
numerics alone keep it near 1e-4 in bf16. Far above that, the trainer is learning from samples of another
policy: weight sync delivering wrong bytes (CUDA IPC once handed the engine another bucket's bytes on every
other version: ~10 nats per token), engine and trainer computing different functions, or routing replay off.
A run whose KL passes `train.behaviour_kl_bound` says so on the console and in error.log; once per episode
(the first step over the bound, and again when it is back under it), so a bad run is seen on its first step
without a line every step.
"""

from __future__ import annotations

from typing import Callable, Mapping

KEY = "is/behaviour_kl"

CAUSES = ("likely causes: weight sync handing the engine wrong bytes (try weights.transport=object_store and "
          "compare), rollout and trainer computing different functions (model.dtype, kernels, "
          "model.routing_replay=false), or samples staler than train.max_staleness suggests")


class BehaviourKLWatch:
    """Feed it every RL step's metrics; it calls `warn(text)` when KL passes `bound` and when it comes back."""

    def __init__(self, bound: float, warn: Callable[[str], None]) -> None:
        self.bound, self.warn = bound, warn
        self.episodes = 0  # passages over the bound so far
        self._start: int | None = None  # first step of the current episode
        self._peak = 0.0

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        kl = metrics.get(KEY)
        if self.bound <= 0 or kl is None:
            return
        if kl > self.bound:
            if self._start is None:
                self._start, self._peak = step, kl
                self.episodes += 1
                stale = metrics.get("staleness/mean")
                self.warn(f"behaviour KL {kl:.3g} per token at step {step} is over train.behaviour_kl_bound="
                          f"{self.bound:g}: the samples were drawn by another policy than the trainer's "
                          f"(importance weights {metrics.get('is/weight_min', float('nan')):.3g}.."
                          f"{metrics.get('is/weight_max', float('nan')):.3g}"
                          + (f", staleness/mean {stale:.2f}" if stale is not None else "") + f"); {CAUSES}")
            self._peak = max(self._peak, kl)
        elif self._start is not None:
            self.warn(f"behaviour KL back under {self.bound:g} at step {step} ({kl:.3g}) after "
                      f"{step - self._start} step(s) over it (peak {self._peak:.3g})")
            self._start = None
