"""`moerl demo` (`make demo`): the embedded default end to end on one CPU, until the RL loop lands.

Builds the tiny demo MoE from `configs/demo.toml`, writes it as a Hugging Face checkpoint under
`<run.dir>/model`, loads it back, checks the reload gives the same logits, and generates greedily
from a few prompts, printing the experts each MoE layer chose for the first generated token.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from moerl.config import load_config
from moerl.model import MoECausalLM, build_model, load_pretrained, save_pretrained, tiny_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.no_grad()
def greedy(model: MoECausalLM, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Plain full-recompute greedy decoding (the rollout engine replaces this with a KV-cached engine)."""
    ids = torch.tensor([prompt])
    first_routing = None
    for _ in range(new_tokens):
        out = model.forward_full(ids)
        if first_routing is None:
            first_routing = out.routed_experts_BTLK[0, -1]
        ids = torch.cat([ids, out.logits_BTV[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist(), first_routing


def main(argv: list[str]) -> int:
    config_path = argv[0] if argv and not argv[0].startswith("--") else "configs/demo.toml"
    overrides = argv[1:] if argv and not argv[0].startswith("--") else argv
    cfg = load_config(config_path if Path(config_path).exists() else None, overrides)
    torch.manual_seed(cfg.run.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    arch = tiny_config()
    t0 = time.perf_counter()
    model = build_model(arch, dtype=DTYPES[cfg.model.dtype], seed=cfg.run.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"built tiny MoE: {params:,} parameters, {arch.num_hidden_layers} layers, "
          f"{arch.num_experts} experts top-{arch.num_experts_per_tok}")
    out_dir = Path(cfg.run.dir) / "model"
    save_pretrained(model, out_dir)
    reloaded = load_pretrained(out_dir, dtype=DTYPES[cfg.model.dtype])
    probe = torch.randint(0, arch.vocab_size, (2, 16))
    diff = (model(probe) - reloaded(probe)).abs().max().item()
    print(f"wrote and reloaded Hugging Face checkpoint {out_dir} (max logit difference {diff:.1e})")
    if diff != 0.0:
        raise SystemExit("reloaded model disagrees with the saved one")
    gen = torch.Generator().manual_seed(cfg.run.seed)
    for i in range(3):
        prompt = torch.randint(0, arch.vocab_size, (8,), generator=gen).tolist()
        tokens, routing = greedy(reloaded, prompt, cfg.rollout.max_new_tokens)
        print(f"prompt {i}: {prompt} -> {tokens[:12]}{' ...' if len(tokens) > 12 else ''}")
        print(f"  experts for the first new token, per MoE layer: {routing.tolist()}")
    print(f"demo finished in {time.perf_counter() - t0:.1f}s")
    return 0
