"""The rollout engine on a GPU against the trainer: the log-probs and experts the engine reports for sampled
completions are the ones the trainer computes for the same tokens, in bf16, on every path the engine takes.

The workload covers every way a completion ends (EOS, another stop id, max_new_tokens, max_seq_len), decode in
CUDA graphs through the paged Triton kernel, groups that share their prompt and prompts that share a long prefix
(prefix-cache hits), and continuations handed from one engine to another after an abort. The trainer scores
every completion with `PolicyTrainer.token_logprobs` (its float32 master weights cast to bf16, routing replayed,
the rl_step path) and the engine holds those master weights' bf16 cast (what weight sync gives it).

Bounds, bf16: mean behaviour KL (k3, per token) <= 1e-3 and the worst token's |log p_trainer - log p_engine|
<= 0.25; expert picks of the engine equal the trainer's own recompute for >= 99% of (token, layer) pairs (a
near-tie router score may flip under bf16 noise; float32 must agree on all). Numbers go to the suite's summary.

Random-init models sample near-uniformly and rarely hit a fixed EOS, so stop ids come from a probe run: a
request whose probe (same seed, no stops) sampled token t at position 6 gets t as its EOS, and the rerun stops
there (same seed, same logits). Stop ids are per request (SamplingParams), as a chat model's are per prompt.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import randomize_

from moerl.model import MoEModelConfig, build_model
from moerl.rollout import Engine, EngineConfig, SamplingParams
from moerl.train.config import LossConfig, OptimConfig
from moerl.train.parallel import compute_cast
from moerl.train.trainer import PolicyTrainer, Sample

MAX_SEQ_LEN = 96
KL_MEAN_MAX = 1e-3
WORST_LOGP = {torch.bfloat16: 0.25, torch.float32: 1e-3}


def arch_for(device: torch.device) -> MoEModelConfig:
    if device.type == "cuda":  # every layer MoE, GQA 4:1, 16 experts top-4: small, but each path at a real width
        return MoEModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16,
                              num_experts_per_tok=4, moe_intermediate_size=256, max_position_embeddings=256)
    return MoEModelConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
                          num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=256)


@pytest.fixture(scope="module")
def policy(device, dtype):
    """(trainer over float32 master weights computing in `dtype`, the engine's model: their `dtype` cast)."""
    arch = arch_for(device)
    master = build_model(arch, dtype=torch.float32, device=device, seed=0)
    randomize_(master, seed=1, std=0.05)  # logits of std ~1 (0.05 x sqrt(512)): far from uniform, like a policy
    trainer = PolicyTrainer(master, OptimConfig(), LossConfig(), compute_dtype=dtype)
    rollout_model = build_model(arch, dtype=dtype, device=device, init=False)
    rollout_model.load_state_dict(trainer.publish_state())
    return trainer, rollout_model.eval()


def engine_for(model, **kw) -> Engine:
    cfg = dict(max_batch_size=32, max_seq_len=MAX_SEQ_LEN, prefill_chunk=64, max_prefill_tokens=2048,
               kv_block_size=16, seed=0)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def prompts_for(vocab: int) -> dict[str, list[list[int]]]:
    """Prompts that share a 40-token prefix (two full KV blocks), of several lengths, one near max_seq_len."""
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(8, vocab, (n,), generator=gen).tolist()  # noqa: E731
    system = ids(40)
    return {"short": [system + ids(n) for n in (4, 9, 13, 20, 7, 16)], "long": [system + ids(44)]}


def workload(vocab: int, probe: list[list[int]] | None = None):
    """(prompts, params, class of each request). Each prompt is a group of 4 samples of distinct seeds."""
    p = prompts_for(vocab)
    prompts, params, kinds = [], [], []
    for i, prompt in enumerate(p["short"][:4]):
        kind = "eos" if i < 2 else "stop_id"
        for j in range(4):
            r = len(prompts)
            if probe is None:  # the probe: no stops, long enough to see the tokens that become stops
                sp = SamplingParams(max_new_tokens=48, temperature=1.0, seed=100 + r)
            elif kind == "eos":
                sp = SamplingParams(max_new_tokens=48, temperature=1.0, seed=100 + r, stop_token_ids=(probe[r][6],))
            else:  # several stop ids, one of them EOS-like but never sampled first: it ends on another id
                sp = SamplingParams(max_new_tokens=48, temperature=1.0, seed=100 + r,
                                    stop_token_ids=(0, probe[r][9], probe[r][11]))
            prompts.append(prompt), params.append(sp), kinds.append(kind)
    if probe is not None:
        for j in range(4):
            prompts.append(p["short"][4]), kinds.append("max_new_tokens")
            params.append(SamplingParams(max_new_tokens=12, temperature=1.0, seed=200 + j))
            prompts.append(p["long"][0]), kinds.append("max_seq_len")
            params.append(SamplingParams(max_new_tokens=48, temperature=1.0, seed=300 + j))
    return prompts, params, kinds


def ended_as(c, kind: str, params: SamplingParams) -> bool:
    if kind == "eos":
        return c.finish_reason == "stop" and c.token_ids[-1] == params.stop_token_ids[0]
    if kind == "stop_id":
        return c.finish_reason == "stop" and c.token_ids[-1] in params.stop_token_ids[1:]
    if kind == "max_new_tokens":
        return c.finish_reason == "length" and len(c.token_ids) == params.max_new_tokens
    return c.finish_reason == "length" and len(c.prompt_token_ids) + len(c.token_ids) == MAX_SEQ_LEN


@pytest.fixture(scope="module")
def sampled(policy, device):
    """Completions of the whole workload on one engine, plus continuations handed over to a second engine."""
    trainer, model = policy
    vocab = model.config.vocab_size
    engine = engine_for(model)
    prompts, params, _ = workload(vocab)
    probe = [c.token_ids for c in engine.generate(prompts, params)]
    prompts, params, kinds = workload(vocab, probe)
    completions = engine.generate(prompts, params)
    stats = dict(engine.stats)
    graphs = engine.graphs
    # Handed-over continuations: four requests run a few steps on `engine`, are aborted (a preempted worker),
    # and continue on a fresh engine (another worker) from their partial completions.
    cont_prompt = prompts_for(vocab)["short"][5]
    cont_params = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=400 + j) for j in range(4)]
    ids = [engine.submit(cont_prompt, sp) for sp in cont_params]
    for _ in range(6):
        engine.step()
    partial = [engine.abort(i) for i in ids]
    other = engine_for(model)
    continued = other.generate([cont_prompt] * 4, cont_params, prefixes=partial)
    return dict(completions=completions, params=params, kinds=kinds, stats=stats, graphs=graphs, engine=engine,
                partial=partial, continued=continued)


def test_the_workload_covers_every_ending_and_engine_path(sampled, device, report):
    kinds, params = sampled["kinds"], sampled["params"]
    counts = {k: 0 for k in ("eos", "stop_id", "max_new_tokens", "max_seq_len")}
    for c, kind, sp in zip(sampled["completions"], kinds, params):
        counts[kind] += ended_as(c, kind, sp)
    report(f"engine vs trainer workload: endings {counts}, prefix-cache hit tokens "
           f"{sampled['stats']['prefix_hit_tokens']}, continuations from {[len(p.token_ids) for p in sampled['partial']]} tokens")
    assert all(n >= 2 for n in counts.values()), counts
    assert sampled["stats"]["prefix_hit_tokens"] >= 32 * 16  # the shared 40-token prefix: 2 blocks a request
    assert all(len(p.token_ids) >= 3 for p in sampled["partial"])  # handed over mid-completion
    for p, c in zip(sampled["partial"], sampled["continued"]):
        assert c.token_ids[: len(p.token_ids)] == p.token_ids and len(c.token_ids) > len(p.token_ids)
    if device.type == "cuda":
        engine = sampled["engine"]
        assert engine.cache.decode_kernel, "decode did not take the paged Triton kernel"
        graphs = sampled["graphs"]
        assert graphs is not None and graphs.disabled_reason is None and graphs.captured, "no CUDA graph decode"


def test_engine_logprobs_equal_the_trainers(policy, sampled, dtype, report):
    trainer, _ = policy
    completions = sampled["completions"] + sampled["continued"]
    samples = [Sample(list(c.prompt_token_ids), list(c.token_ids), list(c.logprobs), 0.0, c.routed_experts)
               for c in completions]
    trainer_logp = trainer.token_logprobs(samples)
    kinds = sampled["kinds"] + ["continuation"] * len(sampled["continued"])
    per_kind: dict[str, list[torch.Tensor]] = {}
    for c, want, kind in zip(completions, trainer_logp, kinds):
        assert want.shape == (len(c.token_ids),)
        per_kind.setdefault(kind, []).append(want - torch.tensor(c.logprobs, dtype=torch.float32))
    all_d = torch.cat([d for ds in per_kind.values() for d in ds]).double()
    k3 = all_d.exp() - 1 - all_d  # KL(behaviour || trainer) estimator on behaviour samples, w = p_trainer / p_engine
    for kind, ds in per_kind.items():
        d = torch.cat(ds).double()
        report(f"engine vs trainer [{kind}]: {d.numel()} tokens, mean KL {float((d.exp() - 1 - d).mean()):.2e}, "
               f"worst |dlogp| {float(d.abs().max()):.3f}")
    assert torch.isfinite(all_d).all()
    assert float(k3.mean()) <= KL_MEAN_MAX, f"mean behaviour KL {float(k3.mean()):.2e} per token"
    assert float(all_d.abs().max()) <= WORST_LOGP[dtype], f"worst token |dlogp| {float(all_d.abs().max()):.3f}"


def test_engine_experts_equal_the_trainers_recompute(policy, sampled, dtype, report):
    """Without replay, the trainer's routers pick the experts the engine recorded at every position."""
    trainer, _ = policy
    master = trainer.model
    same = total = 0
    with torch.no_grad(), compute_cast(master, trainer.compute_dtype):
        for c in sampled["completions"]:
            ids_1T = torch.tensor([c.prompt_token_ids + c.token_ids[:-1]], device=trainer.device)
            want_TLK = master.forward_full(ids_1T).routed_experts_BTLK[0].cpu().sort(-1).values
            got_TLK = c.routed_experts.long().sort(-1).values
            assert got_TLK.shape == want_TLK.shape
            same += int((got_TLK == want_TLK).all(-1).sum())
            total += got_TLK.shape[0] * got_TLK.shape[1]
    report(f"engine vs trainer experts: {same}/{total} (token, layer) picks equal ({dtype})")
    assert same / total >= (0.99 if dtype == torch.bfloat16 else 1.0)
