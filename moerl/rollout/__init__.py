"""The rollout engine: continuous batching, paged KV cache with prefix sharing, sampling, log-probs and routing capture."""

from moerl.rollout.async_engine import AsyncEngine
from moerl.rollout.engine import Engine
from moerl.rollout.engine_config import EngineConfig
from moerl.rollout.engine_group import EngineGroup
from moerl.rollout.sampling import SamplingParams
from moerl.rollout.types import Completion, StepOutput

__all__ = ["AsyncEngine", "Completion", "Engine", "EngineConfig", "EngineGroup", "SamplingParams", "StepOutput"]
