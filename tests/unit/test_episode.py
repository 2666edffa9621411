"""Multi-turn episodes (moerl/loop/episode.py) on the CPU engine: token-exact turns, log-probs bitwise the full
forward's in deterministic mode (as tests/unit/test_rollout_engine.py's single-turn test), the trainer's loss
mask, the history's KV reused through the prefix cache, preemption mid-episode continued by replay on another
engine, and environments that raise, hang past their deadline or kill their tool's process.

The environment here speaks raw token ids (vocab 128): its observation is a few ids derived from the turn, so
the renderer is the identity on them; the engine and the episode driver see exactly what a chat model would.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import torch

from moerl.actors.engine_thread import EngineThread
from moerl.loop.episode import EpisodeLimits, EpisodeStart, run_episode
from moerl.model import MoEModelConfig, build_model
from moerl.rollout import Engine, EngineConfig, SamplingParams
from moerl.tasks.sandbox import ToolLimits, run_tool
from moerl.train.config import LossConfig, OptimConfig
from moerl.train.trainer import PolicyTrainer, Sample

STOPS = tuple(range(10, 22))  # a turn ends on any of these: ~10 tokens a turn from a random-init model


class IdRenderer:
    """Messages whose content is space-separated ids; the prompt and each delta are those ids."""

    def prompt(self, messages):
        return [int(t) for m in messages for t in m["content"].split()]

    def delta(self, observations):
        return [int(t) for m in observations for t in m["content"].split()]


def decode(ids):
    return " ".join(map(str, ids))


class CountingEnv:
    """Deterministic in the transcript: answers turn k with ids from the turn's length; done after `turns`."""

    def __init__(self, turns: int = 3, step=None):
        self.turns, self.k, self._step = turns, 0, step

    def init(self, prompt):
        return prompt, {}

    def step(self, action: str):
        if self._step is not None:
            self._step(action)
        self.k += 1
        n = len(action.split())
        obs = [{"role": "tool", "content": f"{100 + self.k} {30 + n % 50} {101 + self.k}"}]
        return {"observations": [] if self.k >= self.turns else obs, "reward": float(n % 3), "done": self.k >= self.turns}

    def close(self):
        pass


@pytest.fixture(scope="module")
def model():
    cfg = MoEModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                         num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1], initializer_range=0.1)
    return build_model(cfg, seed=0).eval()


def engine_for(model, **kw) -> Engine:
    cfg = dict(max_batch_size=4, max_seq_len=160, kv_block_size=4, deterministic=True)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def params(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=1, temperature=1.0, seed=seed, stop_token_ids=STOPS)


START = EpisodeStart([{"role": "user", "content": "5 17 99 3 42 8 61 7 7 120"}])
LIMITS = EpisodeLimits(max_turns=6, max_tokens=140, tool_timeout_s=10.0)


_IDS = itertools.count()  # request ids unique across the episodes sharing an engine


def threaded_generate(thread: EngineThread):
    def generate(prompt, sp, prefix):
        return thread.submit(prompt, sp, f"ep-{next(_IDS)}", prefix=prefix or None).result(timeout=60)
    return generate


def full_forward_logprobs(model, c):
    ids = c.prompt_token_ids + c.token_ids
    logp_TV = torch.log_softmax(model.forward_full(torch.tensor([ids[:-1]])).logits_BTV[0].float(), dim=-1)
    return logp_TV[len(c.prompt_token_ids) - 1:].gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)


@pytest.fixture(scope="module")
def episodes(model):
    """Four episodes played at once on one engine thread (each blocks on its env while the others decode)."""
    thread = EngineThread(engine_for(model))
    try:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(4) as pool:
            eps = list(pool.map(lambda s: run_episode(threaded_generate(thread), CountingEnv(), START, params(s),
                                                      IdRenderer(), decode, LIMITS), range(4)))
        return eps, dict(thread.engine.stats)
    finally:
        thread.stop()


def test_episodes_are_token_exact_and_bitwise_the_full_forward(model, episodes):
    eps, stats = episodes
    assert [e.status for e in eps] == ["done"] * 4, [(e.status, e.error) for e in eps]
    for e in eps:
        c = e.completion
        assert e.turns == 3 and c.finish_reason == "stop"
        assert len(c.loss_mask) == len(c.token_ids) == len(c.logprobs) == len(c.versions)
        assert c.routed_experts.shape[0] == len(c.prompt_token_ids) + len(c.token_ids) - 1
        runs = [m for i, m in enumerate(c.loss_mask) if i == 0 or m != c.loss_mask[i - 1]]
        assert runs == [1, 0, 1, 0, 1]  # model, observation, model, observation, model
        obs = [t for t, m in zip(c.token_ids, c.loss_mask) if not m]
        assert obs[0] == 101 and obs[2] == 102  # the environment's ids, appended as they are
        logp = full_forward_logprobs(model, c)
        mask = torch.tensor(c.loss_mask, dtype=torch.bool)
        assert torch.equal(torch.tensor(c.logprobs)[mask], logp[mask])  # bitwise, model tokens
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if not m)
    # Each later turn found the history's full blocks in the prefix cache instead of prefilling it again.
    assert stats["prefix_hit_tokens"] >= 4 * 2 * 8


def test_trainer_sees_the_engines_tokens_and_trains_model_tokens_only(model, episodes):
    trainer = PolicyTrainer(model, OptimConfig(), LossConfig())
    eps, _ = episodes
    samples = [Sample(e.completion.prompt_token_ids, e.completion.token_ids, e.completion.logprobs, 1.0,
                      e.completion.routed_experts, e.completion.loss_mask) for e in eps]
    for s, got in zip(samples, trainer.token_logprobs(samples)):
        want = torch.tensor(s.model_behaviour())
        assert got.shape == want.shape == (sum(s.loss_mask),)
        assert torch.allclose(got, want, atol=1e-5, rtol=0)  # packed batch: a different shape, not bitwise


def test_preempted_mid_episode_continues_elsewhere_at_the_same_token(model):
    first = EngineThread(engine_for(model))
    try:
        whole = run_episode(threaded_generate(first), CountingEnv(), START, params(7), IdRenderer(), decode, LIMITS)
    finally:
        first.stop()
    assert whole.status == "done" and whole.turns == 3
    engine = engine_for(model)
    calls = itertools.count()

    def preempting(prompt, sp, prefix):  # the second turn is aborted after 3 decode steps (a spot notice)
        rid = engine.submit(prompt, sp, prefix=prefix)
        for _ in range(3 if next(calls) == 1 else 10_000):
            if rid not in engine.by_id:
                break
            outs = engine.step()
            done = [o.completion for o in outs if o.request_id == rid and o.completion is not None]
            if done:
                return done[0]
        return engine.abort(rid)

    part = run_episode(preempting, CountingEnv(), START, params(7), IdRenderer(), decode, LIMITS)
    assert part.status == "preempted" and part.completion.finish_reason == "abort"
    assert 0 in part.completion.loss_mask and part.completion.loss_mask[-1] == 1  # mid-turn, after an observation
    other = EngineThread(engine_for(model))
    try:
        cont = run_episode(threaded_generate(other), CountingEnv(), START, params(7), IdRenderer(), decode, LIMITS,
                           prefix=part.completion)
    finally:
        other.stop()
    assert cont.status == "done" and cont.reward == whole.reward and cont.turns == whole.turns
    a, b = cont.completion, whole.completion
    assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.logprobs == b.logprobs
    assert torch.equal(a.routed_experts, b.routed_experts)


def test_replay_refuses_an_environment_that_answers_differently(model):
    part = run_episode(lambda p, sp, prefix: _abort_on_second(model, p, sp, prefix), CountingEnv(), START,
                       params(3), IdRenderer(), decode, LIMITS)
    assert part.status == "preempted"

    class Drifting(CountingEnv):
        def step(self, action):
            out = super().step(action)
            out["observations"] = [{"role": "tool", "content": "1 2 3"}]
            return out
    thread = EngineThread(engine_for(model))
    try:
        out = run_episode(threaded_generate(thread), Drifting(), START, params(3), IdRenderer(), decode, LIMITS,
                          prefix=part.completion)
    finally:
        thread.stop()
    assert out.status == "failed" and "replay" in out.error and out.reward is None


def _abort_on_second(model, prompt, sp, prefix):
    engine = engine_for(model)
    if prefix is not None and 0 in (prefix.loss_mask or []):
        rid = engine.submit(prompt, sp, prefix=prefix)
        return engine.abort(rid)
    return engine.generate([prompt], sp, [prefix] if prefix else None)[0]


def test_limits_cut_episodes_with_their_reward(model):
    thread = EngineThread(engine_for(model))
    try:
        gen = threaded_generate(thread)
        turns = run_episode(gen, CountingEnv(turns=9), START, params(1), IdRenderer(), decode,
                            EpisodeLimits(max_turns=2, max_tokens=140))
        tokens = run_episode(gen, CountingEnv(turns=9), START, params(1), IdRenderer(), decode,
                             EpisodeLimits(max_turns=9, max_tokens=12))
    finally:
        thread.stop()
    assert (turns.status, turns.cut_by, turns.turns) == ("cut", "turns", 2) and turns.reward is not None
    assert tokens.status == "cut" and tokens.cut_by == "tokens" and len(tokens.completion.token_ids) <= 12


def _sandboxed(fn, args, timeout_s=1.0):
    def step(action):
        run_tool(fn, args, ToolLimits(timeout_s=timeout_s))
    return step


@pytest.mark.parametrize("fn, args, says", [("time:sleep", [60], "overran"), ("os:_exit", [3], "died"),
                                            ("os:kill", [0, 9], "died"), ("math:sqrt", [-1], "raised")])
def test_a_tool_that_hangs_dies_or_raises_fails_its_episode(model, fn, args, says):
    if fn == "os:kill":
        args = [0, 9]  # pid 0: the tool's own process group (its session)
    thread = EngineThread(engine_for(model))
    t0 = time.monotonic()
    try:
        out = run_episode(threaded_generate(thread), CountingEnv(step=_sandboxed(fn, args)), START, params(2),
                          IdRenderer(), decode, LIMITS)
    finally:
        thread.stop()
    assert out.status == "failed" and says in out.error and out.reward is None, out.error
    assert time.monotonic() - t0 < 30  # bounded by the tool's deadline, not the sleep


def test_an_env_step_that_hangs_in_process_fails_at_its_deadline(model):
    thread, release = EngineThread(engine_for(model)), threading.Event()
    try:
        out = run_episode(threaded_generate(thread), CountingEnv(step=lambda a: release.wait(60)), START, params(2),
                          IdRenderer(), decode, EpisodeLimits(tool_timeout_s=0.3, max_tokens=140))
    finally:
        thread.stop()
        release.set()  # the abandoned step's thread ends now, not during a later test
    assert out.status == "failed" and "tool_timeout_s" in out.error
    for t in [t for t in threading.enumerate() if t.name == "moerl-env-step"]:
        t.join(timeout=10)


def test_sandbox_has_no_network_and_a_private_scratch_dir():
    from moerl.tasks.sandbox import ToolError
    with pytest.raises(ToolError, match="raised"):
        run_tool("socket:create_connection", [["127.0.0.1", 9]], ToolLimits(timeout_s=5))
    cwd = run_tool("os:getcwd", [], ToolLimits(timeout_s=5))
    assert "moerl-tool-" in cwd and not os.path.exists(cwd)  # removed after the call


def test_an_observation_ending_in_a_stop_id_fails_its_episode(model):
    class EndsInStop(CountingEnv):
        def step(self, action):
            out = super().step(action)
            if out["observations"]:
                out["observations"] = [{"role": "tool", "content": f"101 {STOPS[0]}"}]
            return out
    thread = EngineThread(engine_for(model))
    try:
        out = run_episode(threaded_generate(thread), EndsInStop(), START, params(4), IdRenderer(), decode, LIMITS)
    finally:
        thread.stop()
    assert out.status == "failed" and f"stop token id {STOPS[0]}" in out.error


def test_tool_pool_reuses_its_process_and_replaces_a_dead_one():
    from moerl.tasks.sandbox import ToolError, ToolPool
    pool = ToolPool(ToolLimits(timeout_s=1.0))
    try:
        first = run_pool_pid(pool)
        assert run_pool_pid(pool) == first  # reused: no process start per call
        with pytest.raises(ToolError, match="died"):
            pool.run("os:_exit", [3])
        with pytest.raises(ToolError, match="overran"):
            pool.run("time:sleep", [30])
        with pytest.raises(ToolError, match="raised ValueError"):
            pool.run("math:sqrt", [-1])
        assert run_pool_pid(pool) != first and pool.run("operator:add", [2, 3]) == "5"
    finally:
        pool.close()


def run_pool_pid(pool) -> str:
    return pool.run("os:getpid", [])


def test_the_engine_decodes_other_episodes_while_one_waits_for_its_tool(model):
    others_done, order = threading.Event(), []

    def slow_tool(action):  # the first episode's first tool call returns only once the other episodes ended
        if not order:
            order.append("slow tool called")
            assert others_done.wait(60), "the other episodes did not finish while this one waited"
            order.append("slow tool returned")

    thread = EngineThread(engine_for(model))
    try:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(3) as pool:
            slow = pool.submit(run_episode, threaded_generate(thread), CountingEnv(step=slow_tool), START, params(11),
                               IdRenderer(), decode, EpisodeLimits(max_turns=6, max_tokens=140, tool_timeout_s=120))
            deadline = time.monotonic() + 60
            while not order and time.monotonic() < deadline:
                time.sleep(0.01)
            fast = [pool.submit(run_episode, threaded_generate(thread), CountingEnv(), START, params(s), IdRenderer(),
                                decode, LIMITS) for s in (12, 13)]
            assert all(f.result(timeout=60).status == "done" for f in fast)
            others_done.set()
            assert slow.result(timeout=60).status == "done"
    finally:
        others_done.set()
        thread.stop()
    assert order == ["slow tool called", "slow tool returned"]


def test_a_finished_episode_handed_back_replays_to_the_same_outcome(model):
    """A group handed back holds its finished episodes too: replaying them gives the same reward and ending."""
    thread = EngineThread(engine_for(model))
    try:
        gen = threaded_generate(thread)
        for env, limits in ((CountingEnv, LIMITS), (lambda: CountingEnv(turns=9), EpisodeLimits(max_turns=2)),
                            (lambda: CountingEnv(turns=9), EpisodeLimits(max_turns=9, max_tokens=12))):
            first = run_episode(gen, env(), START, params(5), IdRenderer(), decode, limits)
            again = run_episode(gen, env(), START, params(5), IdRenderer(), decode, limits, prefix=first.completion)
            assert (again.status, again.reward, again.cut_by, again.turns) == (
                first.status, first.reward, first.cut_by, first.turns)
            assert again.completion.token_ids == first.completion.token_ids
    finally:
        thread.stop()
