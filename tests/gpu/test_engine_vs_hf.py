"""Greedy generation on a GPU against transformers' `generate` on the same checkpoint.

float32: the engine's tokens equal transformers' for every prompt (clear logit margins: std-0.1 weights).
bf16: the two run different kernels (grouped GEMMs and a paged kernel against transformers' own), so a near tie
may break the other way; each prompt's tokens must be equal, or first differ where transformers' own top-2
logits are within bf16 noise of each other (a tie, not a bug).
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import randomize_

from moerl.model import MoEModelConfig, build_model, load_pretrained, save_pretrained
from moerl.rollout import Engine, EngineConfig, SamplingParams

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

NEW = 16
TIE = 0.125  # bf16 logits of magnitude ~4 carry ~0.03 of rounding each; a gap this small is a tie


def arch_for(device: torch.device) -> MoEModelConfig:
    if device.type == "cuda":
        return MoEModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=[1],
                              norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=256)
    return MoEModelConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


@pytest.fixture(scope="module")
def checkpoint(device, tmp_path_factory):
    arch = arch_for(device)
    model = build_model(arch, seed=0)
    randomize_(model, seed=1, std=0.1)
    path = tmp_path_factory.mktemp("hf")
    save_pretrained(model, path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, arch.vocab_size, (n,), generator=gen).tolist() for n in (1, 3, 8, 17, 30)]
    return arch, path, prompts


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], device) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens of one prompt (eos off: it runs NEW tokens) and its logits at each step."""
    ids = torch.tensor([prompt], device=device)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                      do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                      output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0].float().cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_engine_greedy_equals_transformers_generate(checkpoint, device, dtype, report):
    if dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("bf16 on the CPU smoke: nothing GPU-specific to check")
    arch, path, prompts = checkpoint
    ours = load_pretrained(path, dtype=dtype, device=device)
    engine = Engine(ours.eval(), EngineConfig(max_batch_size=4, max_seq_len=64, prefill_chunk=8, seed=0))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    equal, ties = 0, []
    for prompt, c in zip(prompts, outs):
        want, logits_TV = hf_greedy(hf, prompt, device)
        assert len(c.token_ids) == len(want) == NEW
        if c.token_ids == want:
            equal += 1
            continue
        t = next(i for i, (a, b) in enumerate(zip(c.token_ids, want)) if a != b)
        gap = float(logits_TV[t, want[t]] - logits_TV[t, c.token_ids[t]])
        ties.append(round(gap, 4))
        assert dtype == torch.bfloat16 and gap <= TIE, (
            f"prompt of {len(prompt)} tokens: first differs at token {t} ({c.token_ids[t]} vs transformers' "
            f"{want[t]}) with a logit gap of {gap:.4f}")
    report(f"greedy vs transformers ({dtype}): {equal}/{len(prompts)} prompts equal; near ties at first "
           f"difference: {ties}")
    del hf
