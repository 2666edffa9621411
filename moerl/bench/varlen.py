"""`moerl bench varlen`: a training step (forward + backward of a summed next-token loss) on packed
variable-length sequences against the same sequences right-padded into one [S, max_len] batch.

    python -m moerl.cli bench varlen                 # CUDA, bf16: 64 sequences of 100-2,000 tokens, hidden 1024
    python -m moerl.cli bench varlen --device cpu    # tiny sizes, float32: the bench's own code

Ours is the packed step as the trainer runs it (moerl.model.packing.PackedSeqs: flash varlen attention where
torch has it for this dtype and head layout, else SDPA on a right-padded copy, or the block-diagonal mask where
that is cheaper; the line above the table says which and why), also with activation checkpointing, and with the
block mask forced (where varlen runs). The peer is the padded batch through causal SDPA, what a trainer without
packing runs. Rates count real tokens only. The hardware limit is the model FLOPs of the real tokens
(`packed_flops`: 6 x active weights per token plus each sequence's own causal attention, as `moerl bench train`
counts them) at the bf16 matmul peak measured in the same run. Imports only torch and moerl.model.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moerl.bench import options
from moerl.bench.common import Row, device_description, format_table, measure_matmul_peak, synchronize
from moerl.model import MoECausalLM, MoEModelConfig, build_model, transformer
from moerl.model.layers import varlen_unavailable_reason
from moerl.model.packing import PackedSeqs

CPU_SIZES = dict(num_seqs=6, min_len=3, max_len=40, hidden=64, layers=3, iters=1)


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("varlen").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def make_config(hidden: int, layers: int) -> MoEModelConfig:
    """A small MoE with one dense layer: heads of 64 (16 at tiny hidden sizes), 4 query heads a key-value head."""
    head_dim = 64 if hidden >= 256 else 16
    heads = hidden // head_dim
    return MoEModelConfig(
        vocab_size=8192 if hidden >= 256 else 256, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        head_dim=head_dim, num_experts=16 if hidden >= 256 else 8, num_experts_per_tok=4,
        moe_intermediate_size=hidden // 2, mlp_only_layers=[1] if layers > 2 else [],
        max_position_embeddings=32768)


def packed_flops(config: MoEModelConfig, lengths: list[int]) -> float:
    """Model FLOPs of forward + backward over sequences of these lengths: each token's 6 x active weights and its
    sequence's causal attention (a sequence of n attends over n / 2 positions on average), as bench train."""
    from moerl.bench.train import active_flops_per_token  # here, not above: it loads the trainer (a slower --help)

    return sum(n * active_flops_per_token(config, n) for n in lengths)


def token_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (targets -100 are skipped), as a trainer's loss would be."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(), ignore_index=-100, reduction="sum")


def timed(step: Callable[[], None], iters: int, device: torch.device) -> tuple[float, float]:
    """(median seconds per step, peak GiB allocated; NaN off CUDA), after one warm-up step."""
    step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        samples.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    return sorted(samples)[len(samples) // 2], peak


def draw_sequences(args: argparse.Namespace, vocab: int, device: torch.device) -> list[torch.Tensor]:
    """`num_seqs` sequences [1, n] of random tokens, n uniform in [min_len, max_len]."""
    gen = torch.Generator().manual_seed(args.seed)
    # scripts/gpu/varlen_check.py drew its correctness checks' sequences from `gen` first (they moved to
    # tests/gpu): the same draws keep the timed sequences those of BENCHMARKS.md's runs.
    n_check = min(8, args.num_seqs)
    for n in [1] + torch.randint(args.min_len, args.max_len // 3 + 2, (n_check - 1,), generator=gen).tolist():
        torch.randint(0, vocab, (1, n), generator=gen)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.num_seqs,), generator=gen).tolist()
    return [torch.randint(0, vocab, (1, n), generator=gen).to(device) for n in lens]


def modes(model: MoECausalLM, seqs: list[torch.Tensor], path: str,
          with_mask: bool) -> list[tuple[str, Callable[[], None], bool, bool]]:
    """(name, step, activation checkpointing, block mask forced): ours first, the padded peer last."""
    device = seqs[0].device
    lengths = [s.shape[1] for s in seqs]
    S, T_max = len(seqs), max(lengths)
    packed = PackedSeqs.from_lengths(lengths, device)
    ids_1T = PackedSeqs.pack(seqs)
    tgt_1T = PackedSeqs.pack([torch.cat([s[:, 1:], torch.full_like(s[:, :1], -100)], 1) for s in seqs])
    ids_BT = torch.zeros(S, T_max, dtype=torch.long, device=device)  # right padding: causal SDPA suffices
    tgt_BT = torch.full((S, T_max), -100, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids_BT[i, : s.shape[1]] = s[0]
        tgt_BT[i, : s.shape[1] - 1] = s[0, 1:]

    def step(ids: torch.Tensor, tgt: torch.Tensor, **kw) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            token_loss(model.forward_full(ids, **kw).logits_BTV, tgt).backward()
        return run

    out = [(f"packed, {path}", step(ids_1T, tgt_1T, packed=packed), False, False),
           (f"packed, {path}, checkpointing", step(ids_1T, tgt_1T, packed=packed), True, False)]
    if with_mask and path == "flash varlen":
        out.append(("packed, block mask forced", step(ids_1T, tgt_1T, packed=packed), False, True))
    return out + [(f"padded [{S}, {T_max}], causal SDPA", step(ids_BT, tgt_BT), False, False)]


def run_mode(model: MoECausalLM, step: Callable[[], None], ckpt: bool, force_mask: bool, iters: int,
             device: torch.device) -> tuple[float, float] | None:
    """(seconds per step, peak GiB), or None out of memory."""
    real_reason, real_cheaper = transformer.varlen_unavailable_reason, PackedSeqs.padding_is_cheaper
    model.enable_activation_checkpointing(ckpt)
    if force_mask:  # the block mask, not flash varlen nor the padded SDPA fallback
        transformer.varlen_unavailable_reason = lambda *a: "forced"
        PackedSeqs.padding_is_cheaper = lambda self: False
    try:
        return timed(step, iters, device)
    except torch.OutOfMemoryError:
        return None
    finally:
        transformer.varlen_unavailable_reason, PackedSeqs.padding_is_cheaper = real_reason, real_cheaper
        model.enable_activation_checkpointing(False)
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _varlen_signature() -> str:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return "absent"
    params = set(inspect.signature(varlen_attn).parameters)
    return ", ".join(f"{k}: {k in params}" for k in ("window_size", "is_causal", "enable_gqa"))


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    gpu = device.type == "cuda"
    if not gpu:
        vars(args).update(CPU_SIZES)
    dtype = torch.bfloat16 if gpu else torch.float32
    config = make_config(args.hidden, args.layers)
    model = build_model(config, dtype=dtype, device=device, seed=args.seed)
    c = config
    reason = varlen_unavailable_reason(dtype, device, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    path = "flash varlen" if reason is None else "SDPA fallback"
    print(f"varlen on {device_description(device)}; varlen_attn: {_varlen_signature()}")
    print(f"model: hidden {c.hidden_size}, {c.num_hidden_layers} layers (dense {c.mlp_only_layers}), "
          f"{c.num_attention_heads} heads / {c.num_key_value_heads} kv heads x {c.head_dim}, {c.num_experts} "
          f"experts top-{c.num_experts_per_tok}, {dtype}")
    print(f"packed attention path: {path}" + (f" ({reason})" if reason else ""), flush=True)
    seqs = draw_sequences(args, config.vocab_size, device)
    lengths = [s.shape[1] for s in seqs]
    tokens, padded = sum(lengths), len(seqs) * max(lengths)
    flops = packed_flops(config, lengths)
    peak = measure_matmul_peak(device, dtype)
    print(f"{len(seqs)} sequences, {tokens} tokens packed; padded holds {padded} positions "
          f"({100 * (1 - tokens / padded):.0f}% padding)")
    print(f"{'mode':<44} {'ms/step':>10} {'tokens/s':>12} {'peak GiB':>9}")
    results: dict[str, tuple[float, float] | None] = {}
    for name, step, ckpt, force in modes(model, seqs, path, not args.no_mask):
        results[name] = r = run_mode(model, step, ckpt, force, args.iters, device)
        print(f"{name:<44} " + (f"{r[0] * 1e3:>10.1f} {tokens / r[0]:>12,.0f} {r[1]:>9.2f}" if r else
                                f"{'out of memory':>10}"), flush=True)
    names = list(results)
    print()
    print(format_table(f"varlen: packed (ours) vs padded (peer), forward + backward of {tokens:,} real tokens",
                       rows(results, tokens, flops, peak), peer_name="padded"))
    print(f"hw limit: {flops / tokens / 1e6:,.1f} MFLOP per real token (6 x active weights, each sequence's causal "
          f"attention) at the measured matmul peak {peak / 1e12:,.3g} TFLOP/s")
    return 0 if results[names[0]] is not None else 1


def rows(results: dict[str, tuple[float, float] | None], tokens: int, flops: float, peak: float) -> list[Row]:
    """Per mode but the last (the padded peer): real tokens/s against the peer's, with the ceiling of the model
    FLOPs at the matmul peak; then peak memory (CUDA)."""
    names = list(results)
    peer = results[names[-1]]
    ceiling = tokens * peak / flops
    out = []
    for name in names[:-1]:
        ours = results[name]
        out.append(Row(f"tokens/s, {name}", tokens / ours[0] if ours else math.nan,
                       tokens / peer[0] if peer else None, "tok/s", ceiling=ceiling))
    for name in names[:-1]:  # no rows off CUDA, where no peak is measured
        ours = results[name]
        if ours is not None and math.isfinite(ours[1]):
            out.append(Row(f"peak memory, {name}", ours[1], peer[1] if peer else None, "GiB", higher_is_better=False))
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
