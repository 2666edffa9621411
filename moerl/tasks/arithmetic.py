"""Synthetic arithmetic ("12+7=" -> "19"): the smallest task with an exact, cheap reward.

Infinite and download-free, so it drives demos, tests and smoke runs with the byte tokenizer and a
random-init model; difficulty is one knob (`max_operand`). Prompt `index` is drawn from its own
`random.Random(derive_seed(...))`, so any prompt can be regenerated from (seed, index) alone.

Held out by construction: a hash of the problem's text ("37+48") puts a `held_out` share of all problems in the
eval split, and the training stream never draws them (it draws again), so held-out accuracy measures the rule
the policy learned, not its recall of problems it trained on. The split depends on the problem alone, not on
the seed: every seed of a benchmark scores on the same problems. With up to `_ENUMERATED` problems the eval split
is every held-out problem in a fixed shuffled order (`eval_size` of them); beyond, an endless stream drawn the
same way as training's.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import cached_property

from moerl.tasks.base import Prompt, TaskError, Tokenizer, check_index, completion_text, derive_seed
from moerl.tasks.tokenizer import make_tokenizer

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_ENUMERATED = 1 << 16  # problem spaces up to this size list their held-out problems (eval_size is known)


@dataclass
class ArithmeticConfig:
    max_operand: int = 20  # operands are drawn uniformly from [0, max_operand]
    ops: str = "+"  # operators to draw from, any of "+-*" (e.g. "+-")
    seed: int = 0  # prompt stream seed (load_task fills in the run seed unless set)
    tokenizer: str = "byte"  # "byte" or a local HF tokenizer directory
    # share of all problems (picked by a hash of their text) that only the eval split holds; training never
    # sees them. 0 = both splits draw from every problem (held-out accuracy then measures recall too)
    held_out: float = 0.2

    def __post_init__(self) -> None:
        if self.max_operand < 0:
            raise TaskError(f"arithmetic option 'max_operand' must be >= 0, got {self.max_operand}")
        bad = sorted(set(self.ops) - set(_OPS))
        if not self.ops or bad:
            raise TaskError(f"arithmetic option 'ops' must be a non-empty string of '+-*', got {self.ops!r}")
        if not (isinstance(self.held_out, (int, float)) and 0 <= self.held_out <= 0.9):
            raise TaskError(f"arithmetic option 'held_out' must be in [0, 0.9], got {self.held_out!r}")


def held_out(problem: str, share: float) -> bool:
    """Whether `problem` ("37+48") is in the eval split: its hash's place in [0, 1) is under `share`."""
    digest = hashlib.blake2b(problem.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < share * 2.0 ** 64


class ArithmeticTask:
    """`a<op>b=` prompts; reward 1.0 iff the completion (cut at the first EOS, stripped) is the answer."""

    config_class = ArithmeticConfig

    def __init__(self, config: ArithmeticConfig | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.config = config or ArithmeticConfig()
        self.tokenizer = tokenizer or make_tokenizer(self.config.tokenizer)
        self._ops = "".join(dict.fromkeys(self.config.ops))  # dedupe, keep order: "++-" is "+-"
        space = len(self._ops) * (self.config.max_operand + 1) ** 2
        if self.config.held_out and space <= _ENUMERATED:
            n = len(self._held_out_list)
            if n == 0 or n == space:
                raise TaskError(f"arithmetic option 'held_out'={self.config.held_out} leaves "
                                f"{'no held-out' if n == 0 else 'no training'} problem among the {space} problems of "
                                f"max_operand={self.config.max_operand}, ops={self.config.ops!r}: raise max_operand or "
                                "set held_out=0")

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        op = rng.choice(self._ops)
        a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
        return f"{a}{op}{b}", str(_OPS[op](a, b))

    def _problem(self, index: int, stream: str = "arithmetic") -> tuple[str, str]:
        """Problem `index` of the training stream (or of the endless eval stream): drawn again until it falls on
        the stream's side of the split."""
        check_index(index)
        rng = random.Random(derive_seed(stream, self.config.seed, index))
        want_held_out = stream != "arithmetic"
        while True:
            text, answer = self._draw(rng)
            if not self.config.held_out or held_out(text, self.config.held_out) == want_held_out:
                return f"{text}=", answer

    @cached_property
    def _held_out_list(self) -> list[tuple[str, str]]:
        """Every held-out problem, in a fixed shuffled order (the same for every seed)."""
        problems = [(f"{a}{op}{b}", str(_OPS[op](a, b))) for op in self._ops
                    for a in range(self.config.max_operand + 1) for b in range(self.config.max_operand + 1)]
        problems = [p for p in problems if held_out(p[0], self.config.held_out)]
        random.Random(derive_seed("arithmetic-eval-order")).shuffle(problems)
        return problems

    def _prompt_ids(self, text: str) -> list[int]:
        bos = self.tokenizer.bos_token_id
        return ([] if bos is None else [bos]) + self.tokenizer.encode(text)

    def prompt_at(self, index: int) -> Prompt:
        text, answer = self._problem(index)
        return Prompt(f"arith-{index:06d}", index, self._prompt_ids(text), text, answer)

    @property
    def eval_size(self) -> int | None:
        """Held-out problems when they are listed; None = an endless stream (eval.samples says how many)."""
        space = len(self._ops) * (self.config.max_operand + 1) ** 2
        return len(self._held_out_list) if self.config.held_out and space <= _ENUMERATED else None

    def eval_prompt_at(self, index: int) -> Prompt:
        """The held-out split (moerl/loop/evaluation.py): problems training never draws (see the module doc). With
        held_out = 0, a stream seeded apart from training's over the same problems."""
        size = self.eval_size
        if size is not None:
            check_index(index)
            text, answer = self._held_out_list[index % size]
            text += "="
        else:
            text, answer = self._problem(index, "arithmetic-eval")
        return Prompt(f"arith-eval-{index:06d}", index, self._prompt_ids(text), text, answer)

    def reward(self, prompt: Prompt, completion_token_ids: list[int]) -> float:
        return 1.0 if completion_text(self.tokenizer, completion_token_ids).strip() == prompt.answer else 0.0

    def sft_example(self, index: int) -> tuple[list[int], list[int]]:
        """(prompt ids, answer ids + EOS): a supervised warm start so RL begins with nonzero reward."""
        text, answer = self._problem(index)
        return self._prompt_ids(text), self.tokenizer.encode(answer) + [self.tokenizer.eos_token_id]
