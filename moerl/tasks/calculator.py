"""A calculator tool for arithmetic, the built-in tool-use example (docs/environments.md).

The model may call the tool in Qwen3's syntax, `<tool_call>23*47</tool_call>` (or the JSON form
`<tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}}</tool_call>`); the environment evaluates
the expression in the tool sandbox (moerl/tasks/sandbox.py: model output is evaluated only there; the task keeps a
pool of sandboxed processes, reused across calls) and answers with the result as a tool message. A turn without a
tool call is the final answer: reward 1 when its last number is the right one, else 0. With `tools = false` every
call is answered "no tools" (the no-tool baseline).

`evaluate` walks the expression's syntax tree (numbers, + - * / // % and parentheses; no names, no calls, no
power), so even outside the sandbox it would run no code; the sandbox bounds its time and memory all the same.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from dataclasses import dataclass
from typing import Any

from moerl.tasks.base import check_index, derive_seed
from moerl.tasks.env import EpisodeStart
from moerl.tasks.episodic import EpisodicTask, make_renderer
from moerl.tasks.sandbox import ToolLimits, ToolPool, run_tool
from moerl.tasks.tokenizer import make_tokenizer

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_NUMBER = re.compile(r"-?\d+")


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text, or "error: ..." (a bad expression is the model's mistake,
    answered to it, not a failure of the tool)."""
    def walk(node: ast.AST) -> float | int:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = walk(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"unsupported {type(node).__name__}")
    try:
        if len(expression) > 200:
            raise ValueError("expression longer than 200 characters")
        value = walk(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as exc:
        return f"error: {type(exc).__name__}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def tool_expression(call: str) -> str:
    """The expression of one tool call's body: Qwen3's JSON form or the bare expression."""
    call = call.strip()
    if call.startswith("{"):
        try:
            body = json.loads(call)
            return str(body["arguments"]["expression"])
        except (ValueError, KeyError, TypeError):
            return call
    return call


class CalculatorEnv:
    """env_config: `tools` (bool), `timeout_s` (the sandbox's); extras: `answer`."""

    def __init__(self, env_config: dict[str, Any] | None = None, extras: dict[str, Any] | None = None,
                 pool: ToolPool | None = None) -> None:
        cfg = dict(env_config or {})
        self.tools = bool(cfg.get("tools", True))
        self.limits = ToolLimits(timeout_s=float(cfg.get("timeout_s", 10.0)))
        self.answer = str((extras or {})["answer"])
        self.pool = pool  # the task's reused sandbox processes; None: a fresh process per call

    def _evaluate(self, expression: str) -> str:
        fn = "moerl.tasks.calculator:evaluate"
        return self.pool.run(fn, [expression]) if self.pool is not None else run_tool(fn, [expression], self.limits)

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        return list(prompt), {}

    def step(self, action: str) -> dict[str, Any]:
        calls = _CALL.findall(action)
        if not calls:
            found = _NUMBER.findall(action)
            right = bool(found) and found[-1] == self.answer
            return {"observations": [], "reward": float(right), "done": True, "metadata": {"tool_calls": 0}}
        if not self.tools:
            return {"observations": [{"role": "tool", "content": "no tools"}], "reward": 0.0, "done": False,
                    "metadata": {"tool_calls": len(calls), "tool_errors": len(calls)}}
        results = []
        for call in calls:  # ToolError (the tool died or overran) propagates: the episode fails
            results.append(self._evaluate(tool_expression(call)))
        errors = sum(r.startswith("error") for r in results)
        return {"observations": [{"role": "tool", "content": r} for r in results], "reward": 0.0, "done": False,
                "metadata": {"tool_calls": len(calls), "tool_errors": errors}}

    def close(self) -> None:
        pass


@dataclass
class CalculatorConfig:
    max_operand: int = 99
    ops: str = "*"
    tools: bool = True  # false: the no-tool baseline (calls are answered "no tools")
    sft_tool_share: float = 0.5  # warm-start traces that call the tool; the rest answer directly
    tool_timeout_s: float = 10.0
    chat_format: str = "compact"  # template | chatml | compact (moerl.tasks.episodic.make_renderer)
    tokenizer: str = "byte"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"ops must be characters of '+-*', got {self.ops!r}")
        if not 0 <= self.sft_tool_share <= 1:
            raise ValueError(f"sft_tool_share must be in [0, 1], got {self.sft_tool_share}")


class CalculatorTask(EpisodicTask):
    config_class = CalculatorConfig
    name = "calc"

    def __init__(self, config: CalculatorConfig | None = None) -> None:
        self.config = config or CalculatorConfig()
        self.tokenizer = make_tokenizer(self.config.tokenizer)
        self.renderer = make_renderer(self.tokenizer, self.config.chat_format)
        self.env_config = {"tools": self.config.tools, "timeout_s": self.config.tool_timeout_s}
        self._pool: ToolPool | None = None  # started at the first episode (on a rollout worker, not the driver)

    def problem(self, index: int) -> tuple[str, str]:
        rng = random.Random(derive_seed(self.config.seed, "calculator", index))
        a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
        op = rng.choice(self.config.ops)
        return f"{a}{op}{b}", evaluate(f"{a}{op}{b}")

    def episode_at(self, index: int) -> EpisodeStart:
        check_index(index)
        question, answer = self.problem(index)
        return EpisodeStart([{"role": "user", "content": question + "="}], {"answer": answer})

    def make_env(self, extras: dict[str, Any]) -> CalculatorEnv:
        if self._pool is None:
            self._pool = ToolPool(ToolLimits(timeout_s=self.config.tool_timeout_s))
        return CalculatorEnv(self.env_config, extras, self._pool)

    def sft_example(self, index: int) -> tuple[list[int], list[int]]:
        """Warm-start traces, each one model turn in the context the engine will give it: a tool call after the
        question, or the answer after the tool's result, or (sft_tool_share of the time not) a direct answer."""
        question, answer = self.problem(index // 2)
        eos = [self.tokenizer.eos_token_id]
        prompt = self.renderer.prompt(self.episode_at(index // 2).messages)
        use_tool = derive_seed(self.config.seed, "sft-tool", index // 2) % 1000 < 1000 * self.config.sft_tool_share
        if not use_tool:
            return prompt, self.tokenizer.encode(answer) + eos
        call = self.tokenizer.encode(f"<tool_call>{question}</tool_call>") + eos
        if index % 2 == 0:
            return prompt, call
        return prompt + call + self.renderer.delta([{"role": "tool", "content": answer}]), \
            self.tokenizer.encode(answer) + eos

