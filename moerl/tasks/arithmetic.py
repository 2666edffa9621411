"""Synthetic arithmetic ("12+7=" -> "19"): the smallest task with an exact, cheap reward.

Infinite and download-free, so it drives demos, tests and smoke runs with the byte tokenizer and a
random-init model; difficulty is one knob (`max_operand`). Prompt `index` is drawn from its own
`random.Random(derive_seed(...))`, so any prompt can be regenerated from (seed, index) alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from moerl.tasks.base import Prompt, TaskError, Tokenizer, check_index, completion_text, derive_seed
from moerl.tasks.tokenizer import make_tokenizer

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass
class ArithmeticConfig:
    max_operand: int = 20  # operands are drawn uniformly from [0, max_operand]
    ops: str = "+"  # operators to draw from, any of "+-*" (e.g. "+-")
    seed: int = 0  # prompt stream seed (load_task fills in the run seed unless set)
    tokenizer: str = "byte"  # "byte" or a local HF tokenizer directory

    def __post_init__(self) -> None:
        if self.max_operand < 0:
            raise TaskError(f"arithmetic option 'max_operand' must be >= 0, got {self.max_operand}")
        bad = sorted(set(self.ops) - set(_OPS))
        if not self.ops or bad:
            raise TaskError(f"arithmetic option 'ops' must be a non-empty string of '+-*', got {self.ops!r}")


class ArithmeticTask:
    """`a<op>b=` prompts; reward 1.0 iff the completion (cut at the first EOS, stripped) is the answer."""

    config_class = ArithmeticConfig

    def __init__(self, config: ArithmeticConfig | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.config = config or ArithmeticConfig()
        self.tokenizer = tokenizer or make_tokenizer(self.config.tokenizer)
        self._ops = "".join(dict.fromkeys(self.config.ops))  # dedupe, keep order: "++-" is "+-"

    def _problem(self, index: int, stream: str = "arithmetic") -> tuple[str, str]:
        check_index(index)
        rng = random.Random(derive_seed(stream, self.config.seed, index))
        op = rng.choice(self._ops)
        a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
        return f"{a}{op}{b}=", str(_OPS[op](a, b))

    def _prompt_ids(self, text: str) -> list[int]:
        bos = self.tokenizer.bos_token_id
        return ([] if bos is None else [bos]) + self.tokenizer.encode(text)

    def prompt_at(self, index: int) -> Prompt:
        text, answer = self._problem(index)
        return Prompt(f"arith-{index:06d}", index, self._prompt_ids(text), text, answer)

    eval_size = None  # the held-out stream is endless: eval.samples says how many prompts an eval takes

    def eval_prompt_at(self, index: int) -> Prompt:
        """The held-out split (moerl/loop/evaluation.py): a prompt stream seeded apart from the training one. With
        few possible problems (the demo's 100 sums) both streams hold the same problems; with many, rarely."""
        text, answer = self._problem(index, "arithmetic-eval")
        return Prompt(f"arith-eval-{index:06d}", index, self._prompt_ids(text), text, answer)

    def reward(self, prompt: Prompt, completion_token_ids: list[int]) -> float:
        return 1.0 if completion_text(self.tokenizer, completion_token_ids).strip() == prompt.answer else 0.0

    def sft_example(self, index: int) -> tuple[list[int], list[int]]:
        """(prompt ids, answer ids + EOS): a supervised warm start so RL begins with nonzero reward."""
        text, answer = self._problem(index)
        return self._prompt_ids(text), self.tokenizer.encode(answer) + [self.tokenizer.eos_token_id]
