"""One trained sample as the trainer needs it (built by the loop from a rollout Completion)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.wire import PackedTensorFields


@dataclass
class Sample(PackedTensorFields):
    """One trained sample as the trainer needs it (built by the controller from a Completion)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    routed_experts: torch.Tensor | None = None  # int16 [len(prompt) + len(completion) - 1, L, K]
    # Multi-turn episodes: 1 where the completion token is the model's, 0 where an environment's observation put it
    # there (rendered by the chat template, not sampled): those are inputs, never targets of the loss. None: all 1.
    loss_mask: list[int] | None = None

    def model_behaviour(self) -> list[float]:
        """The behaviour log-probs of the tokens the loss trains (the model's own), in order."""
        if self.loss_mask is None:
            return list(self.behaviour_logprobs)
        return [lp for lp, m in zip(self.behaviour_logprobs, self.loss_mask) if m]

    _packed_fields = ("routed_experts",)  # pickled as raw bytes: see moerl/wire.py
