"""What the rollout engine takes and returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from moerl.wire import PackedTensorFields

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class Completion(PackedTensorFields):
    """One request's result; also the prefix that continues an aborted request on another engine.

    routed_experts: int16 [prompt_len + len(token_ids) - 1, moe_layers, top_k]: the experts each MoE layer
    chose at every position the engine ran through the model (the input positions of the sequence).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # policy version that generated each token
    routed_experts: torch.Tensor | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None  # set when finish_reason == "error": why this request was refused
    seed: int | None = None  # the sampling seed used: continuing with it reproduces the same noise
    # A multi-turn episode (moerl/loop/episode.py) keeps its whole transcript after the prompt in token_ids: 1 marks
    # the model's tokens, 0 an observation's (the environment's, appended between turns; log-prob 0.0, version of the
    # model token before it). The engine never reads it: to the engine an observation is part of the prefix.
    loss_mask: list[int] | None = None

    _packed_fields = ("routed_experts",)  # pickled as raw bytes: see moerl/wire.py

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepOutput:
    """What one engine step produced for one request (streaming)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    completion: Completion | None = None  # set when the request finished in this step
