"""Prompts and reference answers from a local JSONL file, scored by exact match or math equivalence.

The file is read and validated once at load, so a bad row fails the run at startup with its file and
line rather than mid-training. The stream is endless: index i is row perm_e[i % n] of epoch
e = i // n, with perm_e a shuffle seeded by (seed, e) only, so a resumed cursor replays the same rows.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moerl.tasks.base import Prompt, TaskError, Tokenizer, check_index, completion_text, derive_seed
from moerl.tasks.rewards import exact_match, math_answer
from moerl.tasks.tokenizer import make_tokenizer

_REWARDS = {"exact_match": exact_match, "math": math_answer}


@dataclass
class JsonlConfig:
    path: str  # JSONL file, one object per line holding the prompt and the reference answer
    prompt_key: str = "prompt"  # key of the prompt text in each row
    answer_key: str = "answer"  # key of the reference answer (numbers are turned into text)
    reward: Literal["exact_match", "math"] = "math"  # how a completion is compared with the answer
    tokenizer: str = "byte"  # "byte" or a local HF tokenizer directory
    shuffle: bool = True  # reshuffle the rows every epoch (deterministically from seed and epoch)
    seed: int = 0  # shuffle seed (load_task fills in the run seed unless set)

    def __post_init__(self) -> None:
        if self.reward not in _REWARDS:
            raise TaskError(f"jsonl option 'reward' must be one of {', '.join(_REWARDS)}, got {self.reward!r}")


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(derive_seed("jsonl", seed, epoch)).shuffle(order)
    return tuple(order)


def read_rows(path: str, prompt_key: str, answer_key: str) -> list[tuple[str, str]]:
    """(prompt, answer) of each non-blank line; `TaskError` naming file and line for any bad row."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TaskError(f"task data file {path!r} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"cannot read task data file {path!r}: {exc}") from exc
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{path}:{lineno}: invalid JSON: {exc}") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        for key in (prompt_key, answer_key):
            if key not in row:
                raise TaskError(f"{path}:{lineno}: row has no key {key!r} (keys: {', '.join(row)})")
        if not isinstance(row[prompt_key], str):
            raise TaskError(f"{path}:{lineno}: {prompt_key!r} must be a string")
        answer = row[answer_key]
        rows.append((row[prompt_key], answer if isinstance(answer, str) else json.dumps(answer)))
    if not rows:
        raise TaskError(f"task data file {path!r} has no rows")
    return rows


class JsonlTask:
    """Rows of a JSONL file as an endless, per-epoch shuffled prompt stream."""

    config_class = JsonlConfig

    def __init__(self, config: JsonlConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.rows = read_rows(config.path, config.prompt_key, config.answer_key)
        self.tokenizer = tokenizer or make_tokenizer(config.tokenizer)
        self._score = _REWARDS[config.reward]
        self._name = Path(config.path).stem

    def row_of(self, index: int) -> int:
        """Which row prompt `index` is: position index % n of epoch index // n's order."""
        check_index(index)
        epoch, pos = divmod(index, len(self.rows))
        return _permutation(len(self.rows), self.config.seed, epoch)[pos] if self.config.shuffle else pos

    def _prompt_ids(self, text: str) -> list[int]:
        bos = self.tokenizer.bos_token_id
        return ([] if bos is None else [bos]) + self.tokenizer.encode(text)

    def prompt_at(self, index: int) -> Prompt:
        text, answer = self.rows[self.row_of(index)]
        return Prompt(f"{self._name}-{index:06d}", index, self._prompt_ids(text), text, answer)

    def reward(self, prompt: Prompt, completion_token_ids: list[int]) -> float:
        return self._score(completion_text(self.tokenizer, completion_token_ids), prompt.answer)

    def sft_example(self, index: int) -> tuple[list[int], list[int]]:
        """(prompt ids, reference answer ids + EOS); useful when answers are full target texts."""
        text, answer = self.rows[self.row_of(index)]
        return self._prompt_ids(text), self.tokenizer.encode(answer) + [self.tokenizer.eos_token_id]
