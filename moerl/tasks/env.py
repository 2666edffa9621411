"""Environments for multi-turn and tool-using episodes: SkyRL-gym's text-environment interface, adopted as is.

    env = make_env()                              # a fresh environment per episode
    messages, info = env.init(prompt_messages)    # the conversation the model first reads
    out = env.step(model_turn_text)               # {"observations": [...messages], "reward": r, "done": bool, ...}

That is `skyrl_gym.envs.base_text_env.BaseTextEnv` (docs/environments.md says why this one): a skyrl-gym
environment is used unchanged, without moerl importing skyrl-gym (the shape is duck-typed here; only a registered
id needs the package, imported lazily by `skyrl_env`). Server-form environments (OpenEnv's HTTP form) come through
the same interface by `moerl.tasks.env_http.OpenEnvHTTPEnv`.

State travels by deterministic replay of the transcript: an environment must answer the same model turns with
the same observations, rewards and done flags (seed any randomness from the prompt). A worker that continues an
episode another worker started builds a fresh environment and replays the model turns already taken
(`replay_check` in moerl/loop/episode.py refuses an environment whose replayed observation differs). Nothing of
the environment is serialised: it may hold processes, sockets or files.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from moerl.tasks.base import TaskError, import_dotted

Message = dict[str, str]


@runtime_checkable
class Environment(Protocol):
    """SkyRL-gym's `BaseTextEnv`: text in (the model's turn), chat messages out."""

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]: ...

    def step(self, action: str) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass
class EpisodeStart:
    """What a task gives for one episode: the first messages and the environment's per-prompt extras."""

    messages: list[Message]
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvStep:
    """One environment answer, checked: `observations` are the messages the model reads next."""

    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)


class EnvError(RuntimeError):
    """The environment failed this episode (raised, hung past its deadline, died, or answered malformed)."""


def check_step(out: Any) -> EnvStep:
    """An `env.step` result as an EnvStep, or EnvError naming what is wrong with it (one line)."""
    if not isinstance(out, dict):
        raise EnvError(f"env.step returned {type(out).__name__}, expected a dict with observations, reward, done")
    missing = [k for k in ("observations", "reward", "done") if k not in out]
    if missing:
        raise EnvError(f"env.step result lacks {', '.join(missing)}")
    obs, reward, done = out["observations"], out["reward"], out["done"]
    if obs is None:
        obs = []
    if not isinstance(obs, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                            and isinstance(m.get("role"), str) for m in obs):
        raise EnvError(f"env.step observations must be a list of {{role, content}} messages, got {obs!r:.200}")
    if reward is None:
        reward = 0.0  # skyrl-gym's envs return None for a turn without a reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvError(f"env.step reward must be a finite real number, got {reward!r:.100}")
    if not isinstance(done, bool):
        raise EnvError(f"env.step done must be a bool, got {done!r:.100}")
    meta = out.get("metadata") or {}
    return EnvStep([{"role": m["role"], "content": m["content"]} for m in obs], float(reward), done,
                   meta if isinstance(meta, dict) else {})


def load_env_factory(dotted: str, options: dict[str, Any] | None = None) -> Callable[[dict[str, Any]], Environment]:
    """A factory `extras -> Environment` from a dotted path: a class (skyrl-gym's signature, `cls(env_config,
    extras)`) or a function of the same two arguments. `options` is the env_config; `extras` is per prompt
    (skyrl-gym's reward_spec, extra_info)."""
    obj = import_dotted(dotted, "environment")
    if not callable(obj):
        raise TaskError(f"cannot load environment {dotted!r}: {obj!r} is not callable")
    config = dict(options or {})
    return lambda extras: obj(config, extras)


def skyrl_env(env_id: str, options: dict[str, Any] | None = None) -> Callable[[dict[str, Any]], Environment]:
    """A factory for an environment registered in skyrl-gym (`skyrl_gym.make(env_id, ...)`); the package is
    imported here only, so moerl's base install does not need it."""
    try:
        import skyrl_gym  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise TaskError(f"environment {env_id!r} needs skyrl-gym: pip install skyrl-gym ({exc})") from exc
    config = dict(options or {})
    return lambda extras: skyrl_gym.make(env_id, env_config=config, extras=extras)


__all__ = ["EnvError", "EnvStep", "EpisodeStart", "Environment", "Message", "check_step", "load_env_factory", "skyrl_env"]
