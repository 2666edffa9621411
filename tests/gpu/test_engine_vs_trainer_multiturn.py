"""Multi-turn episodes on a GPU against the trainer (the multi-turn twin of test_engine_vs_trainer.py): the log-probs
the engine reports for the model's tokens of each episode are the ones the trainer computes over the very same
transcript (observations included as inputs, masked out of the loss), and the experts at every position, the
observations' too, are the trainer's own choice.

Eight episodes run at once on one engine thread (each waits for its environment while the others decode), through
the paged Triton kernel and CUDA graphs, each turn a continuation whose history comes from the prefix cache. The
environment answers each turn with a few ids derived from it (deterministic in the transcript), so the episodes
are what a chat model's would be, minus the tokenizer. Turns end on any of 200 stop ids (~20 tokens a turn).

Bounds as the single-turn test's, bf16: mean behaviour KL (k3) <= 1e-3 per model token, worst token |dlogp|
<= 0.25; expert picks equal the trainer's recompute for >= 99% of (position, layer) pairs (float32: all).
`MOERL_GPU_SUITE_ON_CPU=1` runs the same code on the CPU at tiny shapes.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from gpu_helpers import randomize_

from moerl.actors.engine_thread import EngineThread
from moerl.loop.episode import EpisodeLimits, run_episode
from moerl.model import MoEModelConfig, build_model
from moerl.rollout import Engine, EngineConfig, SamplingParams
from moerl.tasks.env import EpisodeStart
from moerl.train.config import LossConfig, OptimConfig
from moerl.train.parallel import compute_cast
from moerl.train.trainer import PolicyTrainer, Sample

MAX_SEQ_LEN = 256
KL_MEAN_MAX = 1e-3
WORST_LOGP = {torch.bfloat16: 0.25, torch.float32: 1e-3}
EPISODES = 8


def arch_for(device: torch.device) -> MoEModelConfig:
    if device.type == "cuda":  # as the single-turn test: every layer MoE, GQA 4:1, 16 experts top-4
        return MoEModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16,
                              num_experts_per_tok=4, moe_intermediate_size=256, max_position_embeddings=512)
    return MoEModelConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                          num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=512)


@pytest.fixture(scope="module")
def policy(device, dtype):
    arch = arch_for(device)
    master = build_model(arch, dtype=torch.float32, device=device, seed=0)
    randomize_(master, seed=1, std=0.05)
    trainer = PolicyTrainer(master, OptimConfig(), LossConfig(), compute_dtype=dtype)
    rollout_model = build_model(arch, dtype=dtype, device=device, init=False)
    rollout_model.load_state_dict(trainer.publish_state())
    return trainer, rollout_model.eval()


class IdRenderer:
    def prompt(self, messages):
        return [int(t) for m in messages for t in m["content"].split()]

    def delta(self, observations):
        return [int(t) for m in observations for t in m["content"].split()]


class TurnEnv:
    """Answers turn k with 6 ids from the turn's length and k; done after 4 turns."""

    def __init__(self, vocab: int, low: int):
        self.k, self.vocab, self.low = 0, vocab, low  # ids at or above `low`: no stop id (turns end on those)

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.k += 1
        n = len(action.split())
        ids = [self.low + x % (self.vocab - self.low) for x in (300 + self.k, 250 + n % 40, 7, 300 + self.k, 251, 252)]
        done = self.k >= 4
        return {"observations": [] if done else [{"role": "tool", "content": " ".join(map(str, ids))}],
                "reward": 1.0 if done else 0.0, "done": done}

    def close(self):
        pass


@pytest.fixture(scope="module")
def episodes(policy, device):
    _, model = policy
    vocab = model.config.vocab_size
    engine = Engine(model, EngineConfig(max_batch_size=16, max_seq_len=MAX_SEQ_LEN, prefill_chunk=64,
                                        max_prefill_tokens=2048, kv_block_size=16, seed=0))
    thread = EngineThread(engine)
    ids = itertools.count()
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(8, vocab, (40,), generator=gen).tolist()  # a shared 40-token prefix, as a system prompt
    stops = tuple(range(8, 8 + max(12, 200 * vocab // 4096)))

    def generate(prompt, sp, prefix):
        return thread.submit(prompt, sp, f"ep-{next(ids)}", prefix=prefix).result(timeout=300)

    def one(i):
        prompt = system + torch.randint(8, vocab, (5 + i,), generator=torch.Generator().manual_seed(i)).tolist()
        start = EpisodeStart([{"role": "user", "content": " ".join(map(str, prompt))}])
        sp = SamplingParams(temperature=1.0, seed=100 + i, stop_token_ids=stops)
        return run_episode(generate, TurnEnv(vocab, stops[-1] + 1), start, sp, IdRenderer(), lambda t: " ".join(map(str, t)),
                           EpisodeLimits(max_turns=6, max_tokens=MAX_SEQ_LEN - 60, tool_timeout_s=60))
    try:
        with ThreadPoolExecutor(EPISODES) as pool:
            eps = list(pool.map(one, range(EPISODES)))
    finally:
        thread.stop()
    return eps, dict(engine.stats), engine


def test_episodes_ran_multi_turn_on_every_engine_path(episodes, device, report):
    eps, stats, engine = episodes
    statuses = [e.status for e in eps]
    turns = [e.turns for e in eps]
    report(f"engine vs trainer multi-turn: {EPISODES} episodes {statuses}, turns {turns}, prefix-cache hit tokens "
           f"{stats['prefix_hit_tokens']}, prefill tokens {stats['prefill_tokens']}")
    assert all(s in ("done", "cut") for s in statuses), [(e.status, e.error) for e in eps]
    assert sum(t >= 2 for t in turns) >= EPISODES // 2  # most episodes continued past an observation
    for e in eps:
        c = e.completion
        assert len(c.loss_mask) == len(c.token_ids) and c.routed_experts.shape[0] == len(c.prompt_token_ids) + len(
            c.token_ids) - 1
    assert stats["prefix_hit_tokens"] >= EPISODES * 2 * 16  # the shared prefix, then each turn's own history
    if device.type == "cuda":
        assert engine.cache.decode_kernel, "decode did not take the paged Triton kernel"
        assert engine.graphs is not None and engine.graphs.captured, "no CUDA graph decode"


def test_engine_logprobs_equal_the_trainers_on_model_tokens(policy, episodes, dtype, report):
    trainer, _ = policy
    eps, _, _ = episodes
    cs = [e.completion for e in eps]
    samples = [Sample(list(c.prompt_token_ids), list(c.token_ids), list(c.logprobs), 0.0, c.routed_experts,
                      list(c.loss_mask)) for c in cs]
    diffs = []
    for s, got in zip(samples, trainer.token_logprobs(samples)):
        want = torch.tensor(s.model_behaviour(), dtype=torch.float32)
        assert got.shape == want.shape == (sum(s.loss_mask),)  # the trainer scores model tokens only
        diffs.append(got - want)
    d = torch.cat(diffs).double()
    k3 = d.exp() - 1 - d
    report(f"engine vs trainer multi-turn: {d.numel()} model tokens, mean KL {float(k3.mean()):.2e}, "
           f"worst |dlogp| {float(d.abs().max()):.3f} ({dtype})")
    assert torch.isfinite(d).all()
    assert float(k3.mean()) <= KL_MEAN_MAX
    assert float(d.abs().max()) <= WORST_LOGP[dtype]


def test_engine_experts_equal_the_trainers_recompute_at_every_position(policy, episodes, dtype, report):
    trainer, _ = policy
    eps, _, _ = episodes
    same = total = 0
    with torch.no_grad(), compute_cast(trainer.model, trainer.compute_dtype):
        for e in eps:
            c = e.completion
            ids_1T = torch.tensor([c.prompt_token_ids + c.token_ids[:-1]], device=trainer.device)
            want_TLK = trainer.model.forward_full(ids_1T).routed_experts_BTLK[0].cpu().sort(-1).values
            got_TLK = c.routed_experts.long().sort(-1).values
            assert got_TLK.shape == want_TLK.shape
            same += int((got_TLK == want_TLK).all(-1).sum())
            total += got_TLK.shape[0] * got_TLK.shape[1]
    report(f"engine vs trainer multi-turn experts: {same}/{total} (position, layer) picks equal ({dtype})")
    assert same / total >= (0.99 if dtype == torch.bfloat16 else 1.0)
