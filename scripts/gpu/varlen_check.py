"""Time packed (variable-length) against padded training steps on a CUDA host.

    python scripts/gpu/varlen_check.py                 # CUDA, bf16, 64 sequences of 100-2000 tokens, hidden 1024
    python scripts/gpu/varlen_check.py --cpu-smoke     # tiny sizes on CPU: the script itself, not the kernels

1. Which attention path packed input takes here (flash varlen, or the SDPA fallback: causal on a right-padded
   copy, or the block-diagonal mask where that is cheaper; and why).
2. Forward + backward time, tokens/s and peak memory: packed (varlen), packed with activation checkpointing,
   packed with the mask path forced, and the same sequences right-padded to [S, max_len].
The correctness checks (packed forward against per-sequence forwards, packed-loss gradients, activation
checkpointing, the path taken) are tests/gpu/test_varlen_gpu.py (`make test-gpu`). Imports only torch and
moerl.model.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a plain checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moerl.model import MoECausalLM, MoEModelConfig, build_model, transformer  # noqa: E402
from moerl.model.layers import varlen_unavailable_reason  # noqa: E402
from moerl.model.packing import PackedSeqs  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (checks the script runs)")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=2000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-mask-timing", action="store_true", help="skip timing the O(T^2) mask path")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.num_seqs, args.min_len, args.max_len, args.hidden, args.layers, args.iters = 6, 3, 40, 64, 3, 1
    return args


def make_config(hidden: int, layers: int) -> MoEModelConfig:
    head_dim = 64 if hidden >= 256 else 16
    heads = hidden // head_dim
    return MoEModelConfig(
        vocab_size=8192 if hidden >= 256 else 256, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        head_dim=head_dim, num_experts=16 if hidden >= 256 else 8, num_experts_per_tok=4,
        moe_intermediate_size=hidden // 2, mlp_only_layers=[1] if layers > 2 else [],  # one dense layer
        max_position_embeddings=32768,
    )


def token_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (targets -100 are skipped), as a trainer's loss would be."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(), ignore_index=-100, reduction="sum")


def timed(step: Callable[[], None], iters: int, device: torch.device) -> tuple[float, float]:
    """Seconds per step and peak GiB allocated, after one warm-up step."""
    cuda = device.type == "cuda"
    step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    return (time.perf_counter() - t0) / iters, peak


def timings(model: MoECausalLM, seqs: list[torch.Tensor], iters: int, with_mask: bool) -> None:
    device = seqs[0].device
    lengths = [s.shape[1] for s in seqs]
    S, T_max, tokens = len(seqs), max(lengths), sum(lengths)
    packed = PackedSeqs.from_lengths(lengths, device)
    ids_1T = PackedSeqs.pack(seqs)
    tgt_1T = PackedSeqs.pack([torch.cat([s[:, 1:], torch.full_like(s[:, :1], -100)], 1) for s in seqs])
    ids_BT = torch.zeros(S, T_max, dtype=torch.long, device=device)  # right padding: causal SDPA suffices
    tgt_BT = torch.full((S, T_max), -100, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids_BT[i, : s.shape[1]] = s[0]
        tgt_BT[i, : s.shape[1] - 1] = s[0, 1:]

    def step(ids, tgt, **kw) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            token_loss(model.forward_full(ids, **kw).logits_BTV, tgt).backward()
        return run

    c = model.config
    path = "SDPA fallback" if varlen_unavailable_reason(
        model.lm_head.weight.dtype, device, c.num_attention_heads, c.num_key_value_heads, c.head_dim) else "varlen"
    modes: list[tuple[str, Callable[[], None], bool, str]] = [
        (f"packed, {path}", step(ids_1T, tgt_1T, packed=packed), False, ""),
        (f"packed, {path}, checkpointing", step(ids_1T, tgt_1T, packed=packed), True, ""),
        (f"padded [{S}, {T_max}], causal SDPA", step(ids_BT, tgt_BT), False, ""),
    ]
    if with_mask and path == "varlen":  # the mask path forced, for comparison
        modes.append(("packed, SDPA block mask (forced)", step(ids_1T, tgt_1T, packed=packed), False, "mask"))
    print(f"\n{S} sequences, {tokens} tokens packed; padded holds {S * T_max} positions "
          f"({100 * (1 - tokens / (S * T_max)):.0f}% padding)")
    print(f"{'mode':<40} {'ms/step':>10} {'tokens/s':>12} {'peak GiB':>9}")
    real_reason, real_cheaper = transformer.varlen_unavailable_reason, PackedSeqs.padding_is_cheaper
    for name, run, ckpt, force in modes:
        model.enable_activation_checkpointing(ckpt)
        if force == "mask":
            transformer.varlen_unavailable_reason = lambda *a: "forced"
            PackedSeqs.padding_is_cheaper = lambda self: False  # the mask, not the padded SDPA fallback
        try:
            sec, peak = timed(run, iters, device)
            print(f"{name:<40} {sec * 1e3:>10.1f} {tokens / sec:>12,.0f} {peak:>9.2f}")
        except torch.OutOfMemoryError:
            print(f"{name:<40} {'out of memory':>10}")
        finally:
            transformer.varlen_unavailable_reason, PackedSeqs.padding_is_cheaper = real_reason, real_cheaper
            model.enable_activation_checkpointing(False)
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main() -> int:
    args = parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("no CUDA device here: run on a CUDA host, or pass --cpu-smoke")
        return 2
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.bfloat16
    config = make_config(args.hidden, args.layers)
    torch.manual_seed(args.seed)
    model = build_model(config, dtype=dtype, device=device, seed=args.seed)

    try:
        from torch.nn.attention.varlen import varlen_attn
        params = set(inspect.signature(varlen_attn).parameters)
        sig = f"window_size: {'window_size' in params}, is_causal: {'is_causal' in params}, " \
              f"enable_gqa: {'enable_gqa' in params}"
    except ImportError:
        sig = "absent"
    reason = varlen_unavailable_reason(dtype, device, config.num_attention_heads, config.num_key_value_heads,
                                       config.head_dim)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {name}; varlen_attn: {sig}")
    print(f"model: hidden {config.hidden_size}, {config.num_hidden_layers} layers (dense {config.mlp_only_layers}), "
          f"{config.num_attention_heads} heads / {config.num_key_value_heads} kv heads x {config.head_dim}, "
          f"{config.num_experts} experts top-{config.num_experts_per_tok}, {dtype}")
    print(f"packed attention path: {'flash varlen' if reason is None else 'SDPA (padded copy or block mask): ' + reason}\n")

    gen = torch.Generator().manual_seed(args.seed)
    # The correctness checks that moved to tests/gpu drew their sequences from `gen` first: the same draws keep
    # the timed sequences those of BENCHMARKS.md's runs.
    n_check = min(8, args.num_seqs)
    for n in [1] + torch.randint(args.min_len, args.max_len // 3 + 2, (n_check - 1,), generator=gen).tolist():
        torch.randint(0, config.vocab_size, (1, n), generator=gen)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.num_seqs,), generator=gen).tolist()
    seqs = [torch.randint(0, config.vocab_size, (1, n), generator=gen).to(device) for n in lens]
    timings(model, seqs, args.iters, with_mask=not args.no_mask_timing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
