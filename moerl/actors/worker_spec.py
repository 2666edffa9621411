"""What a rollout worker is built from: its spec (sent once at actor creation) and the model as the rollout runs
it. Both the worker (rollout_worker.py, one engine) and the ranks of its engine group (engine_ranks.py, ep_size > 1)
build their model from these, so neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from moerl.loop.episode import EpisodeLimits
from moerl.rollout import EngineConfig, SamplingParams


@dataclass
class WorkerSpec:
    """Everything a worker needs to build itself (picklable; sent once at actor creation)."""

    arch: dict  # MoEModelConfig fields (HF config dict)
    model_path: str  # HF checkpoint dir to start from; "" = random init (weights arrive before any work)
    dtype: str
    device: str
    engine: EngineConfig
    sampling: SamplingParams
    task_name: str
    task_options: dict
    seed: int
    threads: int = 1
    grace_s: float = 90.0
    imds_url: str = ""  # e.g. http://169.254.169.254/latest/meta-data/spot/instance-action; "" = off
    imds_interval_s: float = 5.0
    group_timeout_s: float = 600.0
    ep_size: int = 1  # ranks of the engine: > 1 runs an engine group (moerl/actors/engine_ranks.py)
    reward_timeout_s: float = 60.0  # a reward past this fails its sample (task.reward_timeout_s)
    episode_limits: EpisodeLimits = EpisodeLimits()  # multi-turn tasks: rollout.max_turns, max_episode_tokens, tool_timeout_s
    expert_bias: bool = False  # choose experts with the router's expert bias, as the trainer does (it arrives with the weights)


def rollout_model(model, spec: WorkerSpec):
    """The model as the rollout runs it: routing as the trainer's (the expert bias on when the trainer uses it)."""
    if spec.expert_bias:
        model.enable_expert_bias()
    return model
