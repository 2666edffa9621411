"""Guess-the-number as a task (moerl/tasks/guess.py is the environment): secrets drawn per prompt index."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from moerl.tasks.base import check_index, derive_seed
from moerl.tasks.env import EpisodeStart
from moerl.tasks.episodic import EpisodicTask, make_renderer
from moerl.tasks.guess import GuessEnv
from moerl.tasks.tokenizer import make_tokenizer


@dataclass
class GuessConfig:
    low: int = 0
    high: int = 9
    chat_format: str = "compact"
    tokenizer: str = "byte"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.high <= self.low:
            raise ValueError(f"high must be > low, got [{self.low}, {self.high}]")


class GuessTask(EpisodicTask):
    config_class = GuessConfig
    name = "guess"

    def __init__(self, config: GuessConfig | None = None) -> None:
        self.config = config or GuessConfig()
        self.tokenizer = make_tokenizer(self.config.tokenizer)
        self.renderer = make_renderer(self.tokenizer, self.config.chat_format)

    def episode_at(self, index: int) -> EpisodeStart:
        check_index(index)
        c = self.config
        secret = random.Random(derive_seed(c.seed, "guess", index)).randint(c.low, c.high)
        return EpisodeStart([{"role": "user", "content": f"guess {c.low}-{c.high}"}],
                            {"secret": secret, "low": c.low, "high": c.high, "answer": str(secret)})

    def make_env(self, extras: dict[str, Any]) -> GuessEnv:
        return GuessEnv({}, extras)

    def sft_example(self, index: int) -> tuple[list[int], list[int]]:
        """Warm-start traces of bisection, one model turn each in the context the engine will give it: the
        episode's guesses and hints so far, then the middle of the range still open."""
        start = self.episode_at(index // 4)
        secret, low, high = start.extras["secret"], self.config.low, self.config.high
        ids, turns = self.renderer.prompt(start.messages), []
        while True:
            guess = (low + high) // 2
            turns.append((list(ids), self.tokenizer.encode(str(guess)) + [self.tokenizer.eos_token_id]))
            if guess == secret:
                break
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
            ids += turns[-1][1] + self.renderer.delta([{"role": "user",
                                                        "content": "higher" if guess < secret else "lower"}])
        return turns[index % 4 % len(turns)]
