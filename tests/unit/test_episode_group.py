"""A rollout worker's multi-turn groups (moerl/actors/episodes.py): a preemption mid-episode hands the group back
with its transcripts and another engine continues every episode at the same turn and token (by replay), equal to
an uninterrupted run; failed episodes get no reward; the batch's episode metrics (moerl/loop/samples.py); the
calculator and guess-the-number examples' environments."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from moerl.actors.engine_thread import EngineThread
from moerl.actors.episodes import run_episode_group
from moerl.loop.episode import EpisodeLimits
from moerl.loop.samples import SampleBuilder, episode_stats
from moerl.loop.types import GroupTask
from moerl.model import MoEModelConfig, build_model
from moerl.rollout import Engine, EngineConfig, SamplingParams
from moerl.tasks.calculator import CalculatorEnv, CalculatorTask, evaluate, tool_expression
from moerl.tasks.env import EpisodeStart
from moerl.tasks.guess import GuessEnv
from moerl.tasks.guess_task import GuessTask

STOPS = tuple(range(10, 22))


class Env:
    def __init__(self, extras, fail_on=None):
        self.k, self.fail_on = 0, fail_on

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.k += 1
        if self.k == self.fail_on:
            raise RuntimeError("tool crashed")
        done = self.k >= 3
        return {"observations": [] if done else [{"role": "tool", "content": f"{100 + self.k} {30 + len(action.split())}"}],
                "reward": float(len(action.split()) % 2), "done": done}

    def close(self):
        pass


class Renderer:
    def prompt(self, messages):
        return [int(t) for m in messages for t in m["content"].split()]

    def delta(self, observations):
        return [int(t) for m in observations for t in m["content"].split()]


class Tok:
    @staticmethod
    def decode(ids):
        return " ".join(map(str, ids))


class Episodic:
    tokenizer, renderer = Tok(), Renderer()

    def __init__(self, fail_sample=None):
        self.made, self.fail_sample = 0, fail_sample

    def episode_at(self, index):
        return EpisodeStart([{"role": "user", "content": "5 17 99 3 42 8 61"}], {"index": index})

    def make_env(self, extras):
        self.made += 1
        return Env(extras, fail_on=2 if self.fail_sample is not None and self.made == self.fail_sample + 1 else None)


@pytest.fixture(scope="module")
def model():
    cfg = MoEModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                         num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1], initializer_range=0.1)
    return build_model(cfg, seed=0).eval()


def play(model, task, episodic, preempting=None):
    thread = EngineThread(Engine(model, EngineConfig(max_batch_size=4, max_seq_len=160, kv_block_size=4,
                                                     deterministic=True)))
    try:
        return run_episode_group(task, episodic=episodic, engine=thread,
                                 sampling=SamplingParams(temperature=1.0, stop_token_ids=STOPS),
                                 seed_of=lambda i: 1000 + i, limits=EpisodeLimits(max_turns=5, max_tokens=140),
                                 preempting=preempting or threading.Event(), timeout_s=60, worker_id="w")
    finally:
        thread.stop()


def test_preempted_group_continues_on_another_engine_as_if_never_stopped(model):
    whole = play(model, GroupTask("g", 0, [5, 17, 99, 3, 42, 8, 61], 3), Episodic())
    assert whole.status == "ok" and all(r is not None for r in whole.rewards)

    class Preempting(Episodic):  # the spot notice arrives while an episode is at its second turn's tool
        def make_env(self, extras):
            env = super().make_env(extras)
            step = env.step

            def stepping(action):
                out = step(action)
                if env.k == 2:
                    preempting.set()
                return out
            env.step = stepping
            return env
    preempting = threading.Event()
    task = GroupTask("g", 0, [5, 17, 99, 3, 42, 8, 61], 3)
    handed = play(model, task, Preempting(), preempting)
    assert handed.status == "preempted" and len(handed.completions) == 3
    assert any(0 in (c.loss_mask or []) for c in handed.completions)  # some episode got past its first turn
    task.partials = handed.completions  # what the work queue keeps and leases again
    cont = play(model, task, Episodic())
    assert cont.status == "ok" and cont.rewards == whole.rewards
    for a, b in zip(cont.completions, whole.completions):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.logprobs == b.logprobs


def test_a_failed_episode_has_no_reward_and_is_not_trained(model):
    result = play(model, GroupTask("g", 0, [5, 17, 99, 3, 42, 8, 61], 3), Episodic(fail_sample=1))
    assert result.status == "ok" and result.rewards[1] is None and "tool crashed" in result.reward_errors[1]
    assert [e["status"] for e in result.episodes].count("failed") == 1
    builder = SampleBuilder(CalculatorTask(), True, 2, 6)
    samples, rows, stats = builder.build([result], step=0, version=0)
    assert len(samples) == 2 and stats["samples_failed"] == 1 and stats["episode/failed"] == 1
    assert all(s.loss_mask is not None and 0 in s.loss_mask for s in samples)
    assert stats["episode/turns_mean"] > 1 and stats["episode/obs_tokens_mean"] > 0


def test_episode_stats_count_limits_and_tool_errors():
    rows = [{"status": "cut", "turns": 2, "tool_calls": 2, "tool_errors": 1, "model_tokens": 10, "obs_tokens": 4,
             "cut_by": "turns"},
            {"status": "done", "turns": 1, "tool_calls": 0, "tool_errors": 0, "model_tokens": 3, "obs_tokens": 0,
             "cut_by": None}]
    s = episode_stats(rows)
    assert (s["episode/turns_mean"], s["episode/tool_calls_mean"], s["episode/tool_error_frac"]) == (1.5, 1.0, 0.5)
    assert (s["episode/cut_turns"], s["episode/cut_tokens"], s["episode/failed"]) == (1, 0, 0)
    assert episode_stats([]) == {}


def test_calculator_tool_in_its_sandbox():
    assert evaluate("23*47") == "1081" and evaluate("(2+3)*4") == "20" and evaluate("7/2") == "3.5"
    assert evaluate("__import__('os')").startswith("error") and evaluate("2**10").startswith("error")
    assert tool_expression('{"name": "calculator", "arguments": {"expression": "6*7"}}') == "6*7"
    env = CalculatorEnv({"timeout_s": 10}, {"answer": "42"})
    out = env.step("<tool_call>6*7</tool_call>")
    assert out["observations"] == [{"role": "tool", "content": "42"}] and not out["done"]
    assert env.step("it is 42")["reward"] == 1.0 and env.step("41")["reward"] == 0.0
    no_tools = CalculatorEnv({"tools": False}, {"answer": "42"}).step("<tool_call>6*7</tool_call>")
    assert no_tools["observations"][0]["content"] == "no tools" and no_tools["metadata"]["tool_errors"] == 1


def test_calculator_warm_start_traces_are_what_the_engine_will_show():
    task = CalculatorTask()
    question, answer = task.problem(0)
    prompts = [task.sft_example(i) for i in range(40)]
    calls = [(p, t) for p, t in prompts if task.tokenizer.decode(t).startswith("<tool_call>")]
    answers = [(p, t) for p, t in prompts if "<tool_call>" in task.tokenizer.decode(p)]
    assert calls and answers and len(calls) == len(answers)
    p, t = answers[0]
    assert task.tokenizer.decode(p).endswith("</tool_call>" + task.tokenizer.decode(t[:-1]) + "\n")
    assert task.prompt_at(0).prompt_text == question + "=\n" and task.prompt_at(0).answer == answer


def test_guess_the_number_answers_and_scores_by_turns():
    task = GuessTask()
    start = task.episode_at(5)
    env = task.make_env(start.extras)
    secret = start.extras["secret"]
    wrong = (secret + 1) % 10
    assert env.step(f"{wrong}")["observations"][0]["content"] == ("lower" if wrong > secret else "higher")
    assert env.step("no idea")["observations"][0]["content"] == "say a number"
    assert env.step(str(secret)) == {"observations": [], "reward": 0.9, "done": True, "metadata": {}}
    with pytest.raises(ValueError, match="outside"):
        GuessEnv({}, {"secret": 11, "high": 9})


def test_in_flight_episodes_survive_a_checkpoint(model):
    """A preempted group's transcripts (loss masks included) and a finished group's episode rows go through the
    controller-state codec unchanged, so a resumed run continues each episode where the checkpoint left it."""
    from moerl.checkpoint import decode_controller_state, encode_controller_state
    from moerl.loop.types import STATE_CLASSES

    task = GroupTask("g", 0, [5, 17, 99, 3, 42, 8, 61], 2)
    done = play(model, task, Episodic())
    # Finished transcripts as partials: a resumed worker replays them to their end.
    task.partials = [dataclasses.replace(c, loss_mask=list(c.loss_mask)) for c in done.completions]
    state = {"queue": [task], "results": [done]}
    back = decode_controller_state(encode_controller_state(state, classes=STATE_CLASSES), classes=STATE_CLASSES)
    for a, b in zip(back["queue"][0].partials, task.partials):
        assert a.loss_mask == b.loss_mask and a.token_ids == b.token_ids and a.versions == b.versions
    assert back["results"][0].episodes == done.episodes
    resumed = play(model, back["queue"][0], Episodic())  # replayed to the end: the same rewards as before
    assert resumed.status == "ok" and resumed.rewards == done.rewards


def test_eval_of_a_multi_turn_task_is_refused_before_the_run_starts():
    from pathlib import Path

    from moerl.config import load_config
    from moerl.preflight import PreflightError, check_eval_task

    path = Path(__file__).resolve().parents[2] / "configs" / "tools.toml"
    check_eval_task(load_config(path), CalculatorTask())  # eval off: fine
    with pytest.raises(PreflightError, match="eval.every.*multi-turn"):
        check_eval_task(load_config(path, ["--eval.every=5"]), CalculatorTask())


def test_guess_the_number_warm_start_traces_bisect():
    task = GuessTask()
    for index in range(12):
        prompt, target = task.sft_example(index)
        secret = task.episode_at(index // 4).extras["secret"]
        low, high = 0, 9
        steps = task.tokenizer.decode(prompt).split("\n")[1:-1]  # "<guess><hint>" per earlier turn (EOS not shown)
        for step in steps:
            guess, hint = int(step.rstrip("higherlow")), step.lstrip("0123456789")
            low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)
        assert low <= secret <= high and task.tokenizer.decode(target) == str((low + high) // 2)
        assert target[-1] == task.tokenizer.eos_token_id
