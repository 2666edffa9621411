"""Guess-the-number, a multi-turn environment with feedback between turns (SkyRL-gym's text interface).

The secret comes from the episode's extras (`secret`, `low`, `high`), so a replay meets the same secret. Each turn
the model names a number; the environment answers "higher" or "lower" as a user message, or ends the episode with
reward 1 - 0.1 x (wrong guesses before) when the guess is right, so fewer turns score more. A turn without a number
is answered "say a number"; the episode's turn limit (rollout.max_turns) cuts the rest.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


class GuessEnv:
    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None) -> None:
        extras = dict(extras or {})
        self.secret, self.low, self.high = int(extras["secret"]), int(extras.get("low", 0)), int(extras.get("high", 9))
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"secret {self.secret} outside [{self.low}, {self.high}]")
        self.wrong = 0

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        return list(prompt), {}

    def step(self, action: str) -> dict[str, Any]:
        found = _NUMBER.findall(action)
        if not found:
            return {"observations": [{"role": "user", "content": "say a number"}], "reward": 0.0, "done": False,
                    "metadata": {}}
        guess = int(found[-1])
        if guess == self.secret:
            return {"observations": [], "reward": max(0.0, 1.0 - 0.1 * self.wrong), "done": True, "metadata": {}}
        self.wrong += 1
        hint = "higher" if guess < self.secret else "lower"
        return {"observations": [{"role": "user", "content": hint}], "reward": 0.0, "done": False, "metadata": {}}

    def close(self) -> None:
        pass
