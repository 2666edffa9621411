"""`moerl bench train`: one optimizer step of the RL policy loss, ours against a plain training step.

    python -m moerl.cli bench train                    # GPU: the medium preset's MoE, 128 x 2,048 tokens
    python -m moerl.cli bench train --device cpu       # scaled down: the shape of the costs only

The GPU shape: hidden 1024, 16 layers, 64 experts top-8, vocab 151,936: 1.96B parameters, 0.56B of them active per
token, 0.40B without the input embedding (a lookup, not a matmul: what MFU counts). It is the medium preset, whose
"1.65B" is its total at the byte vocabulary.

Ours: PolicyTrainer with float32 master weights, bf16 compute, packed token-budget micro-batches, chunked
log-probs, activation checkpointing, routing replay. The peer: transformers' Qwen3MoeForCausalLM (grouped_mm
experts) in bf16 with torch AdamW, one forward/backward over the whole padded batch, log-probs from a float32
log_softmax of the full logits: what a plain PyTorch training step does. Both run on the same shapes and
tokens; the peer also runs on the largest batch that fits (halving from the full one), and ours on that batch
too, so their tokens/s compare on equal inputs.

Then (unless --no-split) one more step of ours at the full batch runs under torch.profiler and a table splits it:
attention and expert GEMMs forward/backward, router/dispatch, log-probs, norms and elementwise, recompute,
optimizer, communication, other, idle (moerl/bench/train_split.py says how each kernel is placed).

MFU counts model FLOPs only (6 x active parameters per token, lm_head included, plus causal attention), not
the recompute of activation checkpointing. The table's MFU rows are over the bf16 matmul rate measured in the
same run; a line under it gives ours against the device's datasheet dense bf16 peak too (named, with its source:
`moerl.bench.common.DATASHEET_BF16_TFLOPS`), both on one line.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from moerl.bench import options, train_split
from moerl.bench.common import (Row, datasheet_bf16_peak, device_description, format_table, measure_matmul_peak,
                                mfu_line, synchronize)
from moerl.model import build_model, tiny_config
from moerl.model.config import MoEModelConfig
from moerl.train.config import LossConfig, OptimConfig
from moerl.train.trainer import PolicyTrainer, Sample


CHECKPOINTING = {"full": True, "selective": "selective", "none": False}


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("train").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def _arch(args: argparse.Namespace, gpu: bool) -> MoEModelConfig:
    if gpu:
        return tiny_config(vocab_size=args.vocab or 151936, hidden_size=1024, num_hidden_layers=16,
                           num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                           num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=2048,
                           max_position_embeddings=8192)
    return tiny_config(vocab_size=args.vocab or 4096, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=64, intermediate_size=256, max_position_embeddings=1024)


def _samples(n: int, seq: int, prompt: int, arch: MoEModelConfig) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    L, K, E = len(arch.moe_layer_indices), arch.num_experts_per_tok, arch.num_experts
    out = []
    for i in range(n):
        c = seq + 1 - prompt  # prompt + completion - 1 = seq positions
        ids = torch.randint(0, arch.vocab_size, (prompt + c,), generator=g).tolist()
        routed = torch.rand(seq, L, E, generator=g).argsort(-1)[..., :K].to(torch.int16)
        out.append(Sample(ids[:prompt], ids[prompt:], (-torch.rand(c, generator=g) - 0.5).tolist(),
                          float(i % 2) - 0.5, routed))
    return out


def active_flops_per_token(arch: MoEModelConfig, seq: int) -> float:
    """Model FLOPs of forward + backward per token: 6 x active weights, plus causal attention."""
    D, d, H, G = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads
    attn = D * d * (2 * H + 2 * G)
    moe = arch.num_experts_per_tok * 3 * D * arch.moe_intermediate_size + D * arch.num_experts
    dense = 3 * D * arch.intermediate_size
    layers = sum(attn + (moe if arch.is_moe_layer(i) else dense) for i in range(arch.num_hidden_layers))
    weights = layers + D * arch.vocab_size  # lm_head (the embedding lookup is no matmul)
    attention = arch.num_hidden_layers * 2 * 2 * H * d * seq / 2  # QK^T and PV over half the positions
    return 6 * weights + 3 * attention


def _measure(step, device: torch.device, steps: int) -> tuple[float, float]:
    """(median seconds per step, peak GB) after one warm-up step."""
    step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")
    return sorted(times)[len(times) // 2], peak


def run_ours(arch, samples, args, device, budget: int, split: bool = False,
             checkpointing: str | None = None) -> tuple[float, float, str | None]:
    """(median seconds per step, peak GB, the step split's table when `split`); checkpointing: a mode of
    CHECKPOINTING (default: --checkpointing)."""
    try:
        return _ours(arch, samples, args, device, budget, split, checkpointing or args.checkpointing)
    finally:
        _free(device)  # the trainer is gone with _ours' frame


def _ours(arch, samples, args, device, budget: int, split: bool, checkpointing: str) -> tuple[float, float, str | None]:
    model = build_model(arch, dtype=torch.float32, device=device, seed=0)
    trainer = PolicyTrainer(model, OptimConfig(lr=1e-6), LossConfig(),
                            compute_dtype=torch.bfloat16 if device.type == "cuda" else None,
                            micro_batch_tokens=budget, activation_checkpointing=CHECKPOINTING[checkpointing])
    seconds, peak = _measure(lambda: trainer.rl_step(samples), device, args.steps)
    # after the timed steps (and their peak memory): one more step, profiled
    table = (train_split.format_split(train_split.measure(trainer, samples, device, args.split_top), seconds * 1e3)
             if split else None)
    return seconds, peak, table


def run_peer(arch, samples, args, device) -> tuple[float, float] | str:
    """transformers' model, one padded batch, full-vocabulary log_softmax; "OOM" when it does not fit."""
    try:
        return _peer(arch, samples, args, device)
    except torch.OutOfMemoryError:
        return "OOM"
    finally:
        _free(device)


def _peer(arch, samples, args, device) -> tuple[float, float] | str:
    try:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError:
        return "no transformers"
    hf = Qwen3MoeConfig(**{k: v for k, v in arch.to_hf_dict().items() if k not in ("architectures", "model_type")})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # initialise on the device: a CPU init of ~2B parameters takes minutes
            model = Qwen3MoeForCausalLM(hf)
    finally:
        torch.set_default_dtype(default)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    full = torch.tensor([s.prompt_ids + s.completion_ids for s in samples], device=device)
    ids, targets = full[:, :-1], full[:, 1:]
    mask = torch.zeros_like(targets, dtype=torch.bool)
    mask[:, len(samples[0].prompt_ids) - 1:] = True
    adv = torch.tensor([s.advantage for s in samples], device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(ids).logits
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
        loss = -(logp * adv[:, None] * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
    return _measure(step, device, args.steps)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    args = _parse(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    gpu = device.type == "cuda"
    arch = _arch(args, gpu)
    n, seq = args.samples or (128 if gpu else 8), args.seq or (2048 if gpu else 128)
    prompt, budget = args.prompt or (256 if gpu else 16), args.micro_batch_tokens or (65536 if gpu else 512)
    peak_flops = measure_matmul_peak(device)
    flops_tok = active_flops_per_token(arch, seq)
    print(f"# moerl bench train on {device_description(device)}: hidden {arch.hidden_size}, "
          f"{arch.num_hidden_layers} layers, {arch.num_experts} experts top-{arch.num_experts_per_tok}, vocab "
          f"{arch.vocab_size}; {n} samples x {seq} positions; micro-batches of {budget} tokens; "
          f"activation checkpointing {args.checkpointing}; "
          f"matmul peak {peak_flops / 1e12:.3g} TFLOP/s", flush=True)
    samples = _samples(n, seq, prompt, arch)
    rows: list[Row] = []
    notes: list[str] = []
    mfu_lines: list[str] = []
    datasheet = datasheet_bf16_peak(device)
    try:
        ours = run_ours(arch, samples, args, device, budget, split=not args.no_split)
    except torch.OutOfMemoryError:
        ours = (float("inf"), float("nan"), None)
        notes.append("ours: out of memory at the full batch")
    peer = run_peer(arch, samples, args, device) if args.peer != "none" else "not run"
    print(f"full batch: ours {ours[0]:.3f} s/step, {ours[1]:.1f} GB peak; peer: {peer}", flush=True)
    tokens = n * seq

    def add(label: str, ours_t: tuple, peer_t, count: int) -> None:
        p = peer_t if isinstance(peer_t, tuple) else None
        tok = count * seq
        rows.append(Row(f"{label} tokens/s", tok / ours_t[0], tok / p[0] if p else None, "tok/s"))
        rows.append(Row(f"{label} MFU", 100 * tok * flops_tok / ours_t[0] / peak_flops,
                        100 * tok * flops_tok / p[0] / peak_flops if p else None, "%", ceiling=100.0))
        rows.append(Row(f"{label} peak memory", ours_t[1], p[1] if p else None, "GB", higher_is_better=False))
        mfu_lines.append(mfu_line(f"{label} ours", tok * flops_tok / ours_t[0], peak_flops, datasheet))
        if not p:
            notes.append(f"{label}: the peer did not run ({peer_t})")
    add(f"{n}x{seq}", ours, peer, n)
    if isinstance(peer, str) and peer == "OOM":  # the largest batch the peer fits, for a like-for-like ratio
        m = n // 2
        while m >= 1:
            fit = run_peer(arch, samples[:m], args, device)
            print(f"peer at {m} samples: {fit}", flush=True)
            if isinstance(fit, tuple):
                add(f"{m}x{seq}", run_ours(arch, samples[:m], args, device, budget,
                                           checkpointing=args.equal_batch_checkpointing), fit, m)
                notes.append(f"{m}x{seq}: ours with activation checkpointing {args.equal_batch_checkpointing} "
                             "(--equal-batch-checkpointing), the peer keeps every activation")
                break
            m //= 2
    print(format_table(f"one RL optimizer step ({tokens:,} tokens in the full batch)", rows,
                       peer_name="transformers+AdamW"))
    for line in mfu_lines + notes:
        print(line)
    if ours[2]:
        print(ours[2])
    return 0
