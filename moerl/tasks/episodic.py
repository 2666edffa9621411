"""Tasks whose samples are episodes: a prompt stream plus an environment per episode (moerl/tasks/env.py).

An episodic task has, beside the Task protocol's `tokenizer` and `prompt_at`:

    start = task.episode_at(index)       # EpisodeStart: the first messages and the environment's extras
    env = task.make_env(start.extras)    # a fresh environment per episode (and per replay)
    task.renderer                        # the chat rendering: the first prompt and each observation's delta

The rollout worker plays such a task's samples as episodes (moerl/actors/episodes.py) and takes the reward from
the environment; `reward` is never called. `EnvTask` runs any SkyRL-gym environment over a JSONL file in
SkyRL-gym's dataset layout; `moerl.tasks.calculator` and `moerl.tasks.guess` are built-in examples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moerl.tasks.base import Prompt, TaskError, check_index
from moerl.tasks.chat_delta import ChatMLRenderer, CompactRenderer, Renderer, renderer_for
from moerl.tasks.env import Environment, EpisodeStart, load_env_factory, skyrl_env
from moerl.tasks.tokenizer import make_tokenizer


def is_episodic(task: Any) -> bool:
    return all(hasattr(task, m) for m in ("episode_at", "make_env", "renderer"))


def make_renderer(tokenizer: Any, chat_format: str, template_kwargs: dict[str, Any] | None = None) -> Renderer:
    """`template` (the tokenizer's chat template, or Qwen3's ChatML where it has none), `chatml` (Qwen3's ChatML
    text written out) or `compact` (messages' contents on lines of their own: short episodes for CPU examples)."""
    if chat_format == "template":
        return renderer_for(tokenizer, **(template_kwargs or {}))
    if chat_format == "chatml":
        return ChatMLRenderer(tokenizer)
    if chat_format == "compact":
        return CompactRenderer(tokenizer)
    raise TaskError(f"chat_format must be 'template', 'chatml' or 'compact', got {chat_format!r}")


class EpisodicTask:
    """What every episodic task shares: `prompt_at` from `episode_at`, and no per-completion reward."""

    name = "episode"
    tokenizer: Any
    renderer: Renderer

    def episode_at(self, index: int) -> EpisodeStart:
        raise NotImplementedError

    def make_env(self, extras: dict[str, Any]) -> Environment:
        raise NotImplementedError

    def prompt_at(self, index: int) -> Prompt:
        check_index(index)
        start = self.episode_at(index)
        ids = self.renderer.prompt(start.messages)
        return Prompt(f"{self.name}-{index}", index, ids, self.tokenizer.decode(ids), str(start.extras.get("answer", "")))

    def reward(self, prompt: Prompt, completion_token_ids: list[int]) -> float:
        raise TaskError(f"{type(self).__name__} is scored by its environment, episode by episode")


@dataclass
class EnvTaskConfig:
    path: str  # JSONL rows in SkyRL-gym's dataset layout: {"prompt": [messages], "reward_spec": {...}, "extra_info": {...}}
    env: str  # "skyrl:<registered id>" or a dotted path to an environment class (cls(env_config, extras))
    env_options: dict[str, Any] = field(default_factory=dict)  # the env_config
    tokenizer: str = "byte"
    chat_format: str = "template"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


class EnvTask(EpisodicTask):
    """A SkyRL-gym environment over a SkyRL-gym dataset, both unchanged."""

    config_class = EnvTaskConfig
    name = "env"

    def __init__(self, config: EnvTaskConfig) -> None:
        self.config = config
        self.tokenizer = make_tokenizer(config.tokenizer)
        self.renderer = make_renderer(self.tokenizer, config.chat_format, config.chat_template_kwargs)
        self._factory = (skyrl_env(config.env[len("skyrl:"):], config.env_options) if config.env.startswith("skyrl:")
                         else load_env_factory(config.env, config.env_options))
        self.rows = []
        for n, line in enumerate(Path(config.path).read_text().splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("prompt"), list):
                    raise TaskError(f"{config.path}:{n}: a row needs 'prompt', a list of {{role, content}} messages")
                self.rows.append(row)
        if not self.rows:
            raise TaskError(f"{config.path}: no rows")

    def episode_at(self, index: int) -> EpisodeStart:
        check_index(index)
        row = self.rows[index % len(self.rows)]
        extras = {k: v for k, v in row.items() if k != "prompt"}
        return EpisodeStart(list(row["prompt"]), extras)

    def make_env(self, extras: dict[str, Any]) -> Environment:
        return self._factory(extras)
