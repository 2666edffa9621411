"""The rollout engine against transformers: a moerl checkpoint loaded by AutoModelForCausalLM, greedy
`generate` of each prompt alone, must give the engine's tokens (all prompts in one engine.generate call,
with fewer cache slots than prompts and chunked prefill), and the engine's log-probs must match HF's logits.
"""

from __future__ import annotations

import pytest
import torch

from moerl.model import MoEModelConfig, build_model, save_pretrained
from moerl.rollout import Engine, EngineConfig, SamplingParams

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

VOCAB = 96
NEW = 12

CASES = [
    pytest.param(
        dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=40, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             norm_topk_prob=True, tie_word_embeddings=False),
        id="gqa2-normtopk",
    ),
    pytest.param(
        dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=12,
             intermediate_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
             norm_topk_prob=False, tie_word_embeddings=True, rope_theta=500000.0, mlp_only_layers=[1]),
        id="mqa-nonorm-tied-mlponly1",
    ),
    pytest.param(
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
             intermediate_size=48, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
             norm_topk_prob=False, attention_bias=True),
        id="gqa4-k3-nonorm-bias",
    ),
]

PROMPTS = [
    [17],
    [5, 60, 2],
    [44, 8, 91, 30, 12, 77, 3],
    [9, 9, 50, 61, 2, 85, 40, 33, 71, 18, 6, 27],
    [int(t) for t in torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(0))],  # holds a 0
]


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Non-trivial weights everywhere (norms and biases too), with clear logit and router margins."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.05 * noise)
        else:
            p.copy_(std * noise)


@pytest.fixture(scope="module", params=CASES)
def pair(request, tmp_path_factory):
    """(moerl model, the same checkpoint loaded by transformers)."""
    ours = build_model(MoEModelConfig(vocab_size=VOCAB, **request.param), seed=0)
    randomize_(ours, seed=1)
    ours.eval()
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(ours, path)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.dtype == torch.float32
    return ours, hf


@torch.no_grad()
def hf_greedy(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF greedy generation of one prompt (no padding); eos disabled so it runs NEW tokens. Returns (tokens,
    log-probs of the chosen tokens)."""
    ids = torch.tensor([prompt])
    # An explicit mask: HF would otherwise infer one from pad_token_id and drop prompt tokens equal to it.
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                      eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits_TV = torch.stack(out.logits, 1)[0].float()
    logprobs = torch.log_softmax(logits_TV, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    return tokens, logprobs


def test_engine_greedy_equals_transformers_generate(pair):
    ours, hf = pair
    engine = Engine(ours, EngineConfig(max_batch_size=3, max_seq_len=64, prefill_chunk=5))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0.0))
    assert len(outs) == len(PROMPTS)
    distinct = set()
    for prompt, c in zip(PROMPTS, outs):
        want, want_logprobs = hf_greedy(hf, prompt)
        assert len(want) == NEW
        assert c.finish_reason == "length"
        assert c.token_ids == want, f"prompt of {len(prompt)} tokens"
        assert torch.allclose(torch.tensor(c.logprobs), want_logprobs, atol=1e-5, rtol=0)
        distinct.add(tuple(c.token_ids))
    assert len(distinct) >= 3  # the prompts lead to different continuations


def test_engine_routing_equals_transformers_router(pair):
    """The experts the engine records at every position are the ones HF's routers pick on the full sequence."""
    ours, hf = pair
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    engine = Engine(ours, EngineConfig(max_batch_size=2, max_seq_len=64, prefill_chunk=4))
    outs = engine.generate(PROMPTS[2:4], SamplingParams(max_new_tokens=6, temperature=1.0, top_k=10, seed=3))
    for c in outs:
        seq = torch.tensor([c.prompt_token_ids + c.token_ids[:-1]])
        picked = []
        hooks = [m.register_forward_hook(lambda mod, inp, out: picked.append(out[2].clone()))
                 for m in hf.modules() if isinstance(m, Qwen3MoeTopKRouter)]
        try:
            with torch.no_grad():
                hf(seq)
        finally:
            for h in hooks:
                h.remove()
        assert len(picked) == ours.num_moe_layers > 0
        want = torch.stack(picked, 1)  # [T, L, K]
        assert c.routed_experts.shape == want.shape == (seq.shape[1], ours.num_moe_layers,
                                                        ours.config.num_experts_per_tok)
        assert torch.equal(c.routed_experts.long(), want)
