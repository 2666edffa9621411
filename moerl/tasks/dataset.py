"""Prompts and reference answers from a local dataset (JSONL, Parquet, a saved HF dataset), scored by rewards.

    [task]
    name = "moerl.tasks.dataset:DatasetTask"
    options = { path = "data/train.parquet", answer_key = "reward_model.ground_truth", tokenizer = "models/qwen3" }

A row's prompt is a text (`prompt_key`) or a list of {role, content} messages (`messages_key`, or a list
under `prompt_key` as in verl's Parquet files). With a tokenizer that has a chat template, the prompt ids
are exactly `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`, with `system_prompt`
first when set (unless the row brings its own system message), and a text prompt is sent as one user
message (`wrap_text_prompts = false`: its raw tokens after BOS, as a base model reads it). Without a chat
template, messages are refused at load and a text is its raw tokens.

Every row is read and checked once at load, so a bad row fails the run at startup with its file and line
rather than mid-training. The stream is endless: index i is row perm_e[i % n] of epoch e = i // n, with
perm_e a shuffle seeded by (seed, e) only, so a resumed cursor replays the same rows.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from moerl.tasks.base import Prompt, TaskError, Tokenizer, check_index, completion_text, derive_seed
from moerl.tasks.data import FORMATS, has_field, read_records
from moerl.tasks.data import field as get_field
from moerl.tasks.rewards import reward_terms, score
from moerl.tasks.tokenizer import make_tokenizer

log = logging.getLogger(__name__)
_RESERVED_TEMPLATE_KWARGS = ("add_generation_prompt", "tokenize", "return_dict", "conversation", "messages")


@dataclass
class DatasetConfig:
    path: str  # a .jsonl file, a .parquet file or directory of them, or a `save_to_disk` directory
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"  # auto: from the path
    split: str = "train"  # the split of a saved DatasetDict
    prompt_key: str = "prompt"  # the prompt: a text, or a list of {role, content} messages (verl's layout)
    messages_key: str = "messages"  # a list of {role, content} messages, used instead when a row has it
    answer_key: str = "answer"  # the reference answer; a dotted path reaches nested fields
    reward: Any = "math"  # a name, a dotted path, or a list of them and {name, weight} tables (rewards.py)
    math_timeout_s: int = 5  # bound on each math-verify parse and comparison of the math reward
    tokenizer: str = "byte"  # "byte" or a local HF tokenizer directory
    system_prompt: str = ""  # with a chat template: a system message put first in every prompt
    wrap_text_prompts: bool = True  # with a chat template: a text prompt is sent as one user message
    chat_template_kwargs: dict = field(default_factory=dict)  # passed to the template (enable_thinking = false)
    shuffle: bool = True  # reshuffle the rows every epoch (deterministically from seed and epoch)
    seed: int = 0  # shuffle seed (load_task fills in the run seed unless set)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise TaskError(f"option 'format' must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if not isinstance(self.chat_template_kwargs, dict):
            raise TaskError(f"option 'chat_template_kwargs' must be a table, got {self.chat_template_kwargs!r}")
        reserved = [k for k in self.chat_template_kwargs if k in _RESERVED_TEMPLATE_KWARGS]
        if reserved:
            raise TaskError(f"option 'chat_template_kwargs' may not set {reserved[0]!r}: moerl sets it")
        if self.math_timeout_s < 1:
            raise TaskError(f"option 'math_timeout_s' must be >= 1, got {self.math_timeout_s}")
        reward_terms(self.reward, self.math_timeout_s)  # an unknown or unimportable reward fails here, at load


@dataclass(frozen=True)
class Row:
    text: str | None  # a text prompt, or
    messages: tuple[tuple[str, str], ...] | None  # (role, content) pairs
    answer: str


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(derive_seed("jsonl", seed, epoch)).shuffle(order)
    return tuple(order)


def _messages(where: str, key: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise TaskError(f"{where}: {key!r} must be a non-empty list of {{role, content}} messages")
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise TaskError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content', got {m!r}")
        out.append((m["role"], m["content"]))
    return tuple(out)


def parse_row(where: str, row: dict[str, Any], config: DatasetConfig) -> Row:
    """One row's prompt (text or messages) and answer, or TaskError naming the row and what is wrong."""
    key = config.messages_key if has_field(row, config.messages_key) else config.prompt_key
    if not has_field(row, key):
        raise TaskError(f"{where}: row has neither {config.prompt_key!r} nor {config.messages_key!r} "
                        f"(keys: {', '.join(row)})")
    if not has_field(row, config.answer_key):
        raise TaskError(f"{where}: row has no {config.answer_key!r} (keys: {', '.join(row)})")
    prompt, answer = get_field(row, key), get_field(row, config.answer_key)
    if answer is None:
        raise TaskError(f"{where}: {config.answer_key!r} is null")
    answer = answer if isinstance(answer, str) else json.dumps(answer)
    if isinstance(prompt, str):
        return Row(prompt, None, answer)
    if isinstance(prompt, list):
        return Row(None, _messages(where, key, prompt), answer)
    raise TaskError(f"{where}: {key!r} must be a string or a list of messages, got {type(prompt).__name__}")


def read_rows(config: DatasetConfig) -> list[Row]:
    rows = [parse_row(where, row, config) for where, row in read_records(config.path, config.format, config.split)]
    if not rows:
        raise TaskError(f"task data {config.path!r} has no rows")
    return rows


class DatasetTask:
    """Rows of a local dataset as an endless, per-epoch shuffled prompt stream."""

    config_class = DatasetConfig

    def __init__(self, config: DatasetConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.rows = read_rows(config)
        self.tokenizer = tokenizer or make_tokenizer(config.tokenizer)
        self.terms = reward_terms(config.reward, config.math_timeout_s)
        self.chat = getattr(self.tokenizer, "chat_template", None) is not None
        self._name = Path(config.path).stem
        self._render = functools.lru_cache(maxsize=8192)(self._render_row)
        self._check_chat()

    def _check_chat(self) -> None:
        first_chat = next((r for r in self.rows if r.messages is not None), None)
        if not self.chat:
            if first_chat is not None:
                raise TaskError(f"task data {self.config.path!r} holds chat messages, but tokenizer "
                                f"{self.config.tokenizer!r} has no chat template")
            if self.config.system_prompt:
                raise TaskError(f"option 'system_prompt' needs a tokenizer with a chat template; "
                                f"{self.config.tokenizer!r} has none")
            return
        has_text = any(r.text is not None for r in self.rows)
        if has_text and self.config.system_prompt and not self.config.wrap_text_prompts:
            raise TaskError("option 'system_prompt' cannot reach the text prompts of this data with "
                            "wrap_text_prompts = false (they are sent as raw text)")
        if has_text and self.config.wrap_text_prompts:
            # a warning, so that it shows without logging set up: the prompts differ from the data's text
            log.warning("task %s: text prompts are sent as one user message in the chat template of %s "
                        "(task option wrap_text_prompts = false: as raw text)", self._name, self.config.tokenizer)
        try:  # a template that cannot render these rows fails now, not on a rollout worker
            self._render_row(self.rows.index(first_chat) if first_chat is not None else 0)
        except TaskError:
            raise
        except Exception as exc:  # noqa: BLE001 - jinja errors of the template
            raise TaskError(f"the chat template of {self.config.tokenizer!r} failed on the first row: "
                            f"{type(exc).__name__}: {exc}") from exc

    def row_of(self, index: int) -> int:
        """Which row prompt `index` is: position index % n of epoch index // n's order."""
        check_index(index)
        epoch, pos = divmod(index, len(self.rows))
        return _permutation(len(self.rows), self.config.seed, epoch)[pos] if self.config.shuffle else pos

    def messages(self, row: Row) -> list[dict[str, str]] | None:
        """The chat messages a row is sent as; None for a raw-text prompt."""
        if row.messages is None and not (self.chat and self.config.wrap_text_prompts):
            return None
        pairs = row.messages if row.messages is not None else (("user", row.text or ""),)
        if self.config.system_prompt and pairs[0][0] != "system":
            pairs = (("system", self.config.system_prompt), *pairs)
        return [{"role": role, "content": content} for role, content in pairs]

    def _render_row(self, row_index: int) -> tuple[list[int], str]:
        row = self.rows[row_index]
        messages = self.messages(row)
        if messages is None:
            bos = self.tokenizer.bos_token_id
            return ([] if bos is None else [bos]) + self.tokenizer.encode(row.text or ""), row.text or ""
        kwargs = self.config.chat_template_kwargs
        tok: Any = self.tokenizer
        return tok.apply_chat_template(messages, **kwargs), tok.render_chat(messages, **kwargs)

    def prompt_at(self, index: int) -> Prompt:
        row_index = self.row_of(index)
        ids, text = self._render(row_index)
        return Prompt(f"{self._name}-{index:06d}", index, list(ids), text, self.rows[row_index].answer)

    def reward(self, prompt: Prompt, completion_token_ids: list[int]) -> float:
        return score(self.terms, completion_text(self.tokenizer, completion_token_ids), prompt.answer)

    def sft_example(self, index: int) -> tuple[list[int], list[int]]:
        """(prompt ids, reference answer ids + EOS); useful when answers are full target texts."""
        prompt = self.prompt_at(index)
        return prompt.prompt_token_ids, self.tokenizer.encode(prompt.answer) + [self.tokenizer.eos_token_id]
