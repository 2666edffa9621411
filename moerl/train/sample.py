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

    _packed_fields = ("routed_experts",)  # pickled as raw bytes: see moerl/wire.py
