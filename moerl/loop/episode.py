"""One multi-turn episode: the engine's turns and the environment's answers, token-exact, resumable by replay.

    outcome = run_episode(generate, make_env, start, params, renderer, limits, prefix=partial_or_None)

The whole transcript after the prompt is one `Completion`: `token_ids` holds the model's turns and the
observations between them, `loss_mask` marks which are the model's. After a turn only the observation's ids (the
delta, moerl/tasks/chat_delta.py) are appended and the episode goes back to the engine as a continuation
(`prefix`): the engine finds the history's full KV blocks in its prefix cache and prefills only the rest, and the
same seed keeps the noise of every later position. `generate` blocks only this episode's thread: the engine
decodes the other episodes meanwhile (the rollout worker runs one thread per episode).

Observation tokens get log-prob 0.0 and the version of the model token before them (an episode's staleness is
its oldest model token's), and are left out of the loss by the mask. Routing is kept at every position: later
model tokens attend to keys computed through the observation's experts, so the trainer replays those too.

Spot tolerance: a preempted episode is handed back as its partial Completion (finish_reason "abort"). Whoever
continues it builds a fresh environment and replays the model turns already taken; the environment must answer
them as before (docs/environments.md), else the episode fails naming the turn. An environment that raises,
overruns `limits.tool_timeout_s`, or answers malformed fails the episode: it is counted, never trained as a zero.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Callable, Literal

from moerl.rollout.sampling import SamplingParams
from moerl.rollout.types import Completion
from moerl.tasks.chat_delta import Renderer
from moerl.tasks.env import EnvError, EnvStep, Environment, EpisodeStart, check_step

Generate = Callable[[list[int], SamplingParams, Completion | None], Completion]


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8  # model turns; the episode is cut after this many
    max_tokens: int = 512  # tokens after the prompt, the model's and the observations' together
    tool_timeout_s: float = 30.0  # one env.step (tool call) past this fails the episode


@dataclass
class Episode:
    completion: Completion  # the transcript so far; loss_mask set
    status: Literal["done", "cut", "preempted", "failed"]
    reward: float | None = None  # the sum of the env's rewards; None unless done or cut
    error: str | None = None
    cut_by: str | None = None  # "turns" or "tokens"
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0

    def stats(self) -> dict[str, Any]:
        mask = self.completion.loss_mask or []
        return {"status": self.status, "turns": self.turns, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "model_tokens": sum(mask), "obs_tokens": len(mask) - sum(mask),
                "cut_by": self.cut_by}


def step_with_deadline(env: Environment, action: str, timeout_s: float) -> EnvStep:
    """env.step(action) checked, on a thread of its own so a hang costs `timeout_s`, not the worker (the thread is
    abandoned; tool code that executes model output runs in a killable child process: moerl/tasks/sandbox.py)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["out"] = env.step(action)
        except BaseException as exc:  # noqa: BLE001 - any env bug fails the episode, SystemExit included
            box["exc"] = exc
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="moerl-env-step").start()
    if not done.wait(timeout_s):
        raise EnvError(f"env.step overran tool_timeout_s={timeout_s:g}")
    if "exc" in box:
        exc = box["exc"]
        raise EnvError(f"env.step raised {type(exc).__name__}: {exc}") from None
    return check_step(box["out"])


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


class _Run:
    def __init__(self, generate: Generate, env: Environment, params: SamplingParams, renderer: Renderer,
                 decode: Callable[[list[int]], str], limits: EpisodeLimits) -> None:
        self.generate, self.env, self.params, self.renderer = generate, env, params, renderer
        self.decode, self.limits = decode, limits
        self.stops = set(params.stop_token_ids)
        self.reward, self.turns, self.tool_calls, self.tool_errors = 0.0, 0, 0, 0

    def action(self, ids: list[int]) -> str:
        end = next((i for i, t in enumerate(ids) if t in self.stops), len(ids))
        return self.decode(ids[:end])

    def answer(self, ids: list[int]) -> EnvStep:
        """The env's answer to one model turn; tool calls counted from the Qwen3 syntax unless the env says."""
        text = self.action(ids)
        out = step_with_deadline(self.env, text, self.limits.tool_timeout_s)
        self.turns += 1
        self.tool_calls += int(out.metadata.get("tool_calls", text.count("<tool_call>")))
        self.tool_errors += int(out.metadata.get("tool_errors", 0))
        self.reward += out.reward
        return out


def _append_observation(c: Completion, delta: list[int]) -> None:
    version = c.versions[-1] if c.versions else 0
    c.token_ids += delta
    c.logprobs += [0.0] * len(delta)
    c.versions += [version] * len(delta)
    c.loss_mask += [0] * len(delta)


def _merge(turn: Completion, before: Completion) -> Completion:
    """The engine's completion of one turn with the episode's mask: new tokens are the model's; observation
    log-probs stay 0.0 (deterministic mode rescores every position)."""
    mask = list(before.loss_mask or []) + [1] * (len(turn.token_ids) - len(before.token_ids))
    turn.loss_mask = mask
    turn.logprobs = [lp if m else 0.0 for lp, m in zip(turn.logprobs, mask)]
    return turn


def run_episode(generate: Generate, env: Environment, start: EpisodeStart, params: SamplingParams,
                renderer: Renderer, decode: Callable[[list[int]], str], limits: EpisodeLimits,
                prefix: Completion | None = None, request_id: str = "episode") -> Episode:
    """Play (or continue, from `prefix`) one episode to its end, a limit, a preemption or a failure.
    `params.max_new_tokens` is replaced by the episode's token budget; `params.seed` must be set (a continuation
    elsewhere draws the same noise)."""
    run = _Run(generate, env, params, renderer, decode, limits)
    try:
        messages, _ = env.init(list(start.messages))
        prompt = renderer.prompt(list(messages))
    except BaseException as exc:  # noqa: BLE001
        c = prefix or Completion(request_id, [], loss_mask=[])
        return Episode(c, "failed", error=f"env.init failed: {type(exc).__name__}: {exc}")
    c = Completion(request_id, prompt, loss_mask=[], seed=params.seed) if prefix is None else dataclasses.replace(
        prefix, token_ids=list(prefix.token_ids), logprobs=list(prefix.logprobs), versions=list(prefix.versions),
        loss_mask=list(prefix.loss_mask if prefix.loss_mask is not None else [1] * len(prefix.token_ids)))

    def ended(status: str, error: str | None = None, cut_by: str | None = None) -> Episode:
        c.finish_reason = {"done": "stop", "cut": "length"}.get(status, "abort")
        reward = run.reward if status in ("done", "cut") else None
        return Episode(c, status, reward, error, cut_by, run.turns, run.tool_calls, run.tool_errors)  # type: ignore[arg-type]

    try:
        if prefix is not None:
            if list(prefix.prompt_token_ids) != prompt:
                raise EnvError("replay: env.init rendered a different prompt than the episode started from")
            runs = _runs(c.loss_mask)
            for k, (m, a, b) in enumerate(runs):  # replay every model turn an observation followed
                if m == 1 and k + 1 < len(runs):
                    out = run.answer(c.token_ids[a:b])
                    _, oa, ob = runs[k + 1]
                    if out.done or renderer.delta(out.observations) != c.token_ids[oa:ob]:
                        raise EnvError(f"replay: the environment answered turn {run.turns} differently "
                                       "(environments must be deterministic given the transcript)")
        need_model = not (c.token_ids and c.loss_mask[-1] == 1 and c.token_ids[-1] in run.stops)
        if prefix is not None and prefix.finish_reason == "length" and need_model:
            return ended("cut", cut_by="tokens")  # the engine cut its last turn; a whole last turn is replayed below
        while True:
            if need_model:
                turn = generate(prompt, dataclasses.replace(params, max_new_tokens=limits.max_tokens), c)
                if turn.finish_reason == "error":
                    raise EnvError(f"engine refused the turn: {turn.error}")
                if turn.finish_reason == "stop" and len(turn.token_ids) == len(c.token_ids):
                    # The engine ends a request whose last token is a stop id before sampling: an observation
                    # ending in one would end every later turn unheard.
                    raise EnvError(f"the observation ends with stop token id {c.token_ids[-1]}: the model could not "
                                   "take its turn")
                c = _merge(turn, c)
                if turn.finish_reason == "abort":
                    return ended("preempted")
                if turn.finish_reason == "length":
                    return ended("cut", cut_by="tokens")
            a = max(i for i, m in enumerate([0] + c.loss_mask) if m == 0)  # the last model turn's start
            out = run.answer(c.token_ids[a:])
            if out.done:
                return ended("done")
            if run.turns >= limits.max_turns:
                return ended("cut", cut_by="turns")
            delta = renderer.delta(out.observations)
            if len(c.token_ids) + len(delta) >= limits.max_tokens:
                return ended("cut", cut_by="tokens")
            _append_observation(c, delta)
            need_model = True
    except (EnvError, Exception) as exc:  # noqa: BLE001 - renderer and engine errors fail the episode too
        return ended("failed", error=str(exc) if isinstance(exc, EnvError) else f"{type(exc).__name__}: {exc}")
    finally:
        try:
            env.close()
        except Exception:  # noqa: BLE001, S110 - closing is best effort; the episode's outcome stands
            pass


__all__ = ["Episode", "EpisodeLimits", "EpisodeStart", "Generate", "run_episode", "step_with_deadline"]
