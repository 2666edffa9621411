"""Packed (variable-length) forwards in the model's dtype: which attention path packed input takes, the packed
forward against each sequence's own forward, the gradients of a packed loss against the sum over separate forwards,
and activation checkpointing's gradients against none. Timings: `moerl bench varlen`.

bf16 on CUDA (flash varlen attention), float32 in the CPU smoke run (the SDPA fallback: causal on a right-padded
copy, or the block-diagonal mask). Packed and separate forwards are both in the model's dtype: what differs is the
packing (attention kernel, GEMM shapes), not the precision, so the bounds are bf16 noise, not a float64 error.
Routing is replayed from the separate forwards: bf16 noise must not flip a top-k choice between the two.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import rel_err

from moerl.model import MoECausalLM, MoEModelConfig, build_model, layers
from moerl.model.layers import varlen_unavailable_reason
from moerl.model.packing import PackedSeqs

# The former scripts/gpu/varlen_check.py's bf16 bounds (packed logits seen 6.8e-3 on an H200); float32's for
# the CPU smoke
TOL = {torch.bfloat16: {"logits": 2e-2, "grads": 5e-2}, torch.float32: {"logits": 1e-5, "grads": 1e-4}}


def make_model(device: torch.device, dtype: torch.dtype, seed: int) -> MoECausalLM:
    """Three layers, the middle one dense; GQA 4:1. CUDA: hidden 512, head size 64 (flash varlen's range)."""
    hidden, head_dim, vocab, experts = (512, 64, 8192, 16) if device.type == "cuda" else (64, 16, 256, 8)
    heads = hidden // head_dim
    config = MoEModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=heads // 4, head_dim=head_dim, num_experts=experts,
        num_experts_per_tok=4, moe_intermediate_size=hidden // 2, mlp_only_layers=[1], max_position_embeddings=32768,
    )
    return build_model(config, dtype=dtype, device=device, seed=seed)


def sequences(model: MoECausalLM, device: torch.device, seed: int) -> list[torch.Tensor]:
    """[1, n] token rows: one of a single token, the others of random lengths."""
    gen = torch.Generator().manual_seed(seed)
    low, high, count = (100, 400, 8) if device.type == "cuda" else (3, 14, 6)
    lengths = [1] + torch.randint(low, high + 1, (count - 1,), generator=gen).tolist()
    return [torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device) for n in lengths]


def packing(seqs: list[torch.Tensor]) -> tuple[PackedSeqs, torch.Tensor, torch.Tensor]:
    """(the packing, the packed ids [1, T], packed next-token targets [1, T]: -100 at each sequence's end)."""
    targets = [torch.cat([s[:, 1:], torch.full_like(s[:, :1], -100)], 1) for s in seqs]
    return (PackedSeqs.from_lengths([s.shape[1] for s in seqs], seqs[0].device), PackedSeqs.pack(seqs),
            PackedSeqs.pack(targets))


def token_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (targets -100 skipped), as a trainer's loss would be."""
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(), ignore_index=-100, reduction="sum")


def grads(model: MoECausalLM, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest relative error over the parameters' gradients (NaN counts as worst), and whose."""
    assert got.keys() == want.keys(), f"different gradient sets: {sorted(got.keys() ^ want.keys())[:3]}"
    errs = {n: rel_err(got[n], want[n]) for n in want}
    name = max(errs, key=lambda n: float("inf") if errs[n] != errs[n] else errs[n])
    return errs[name], name


def test_packed_attention_path(device, dtype, monkeypatch):
    """On CUDA in bf16 packed input runs the flash varlen kernel in every layer (BENCHMARKS.md: torch 2.11 on an
    H200 does; losing it costs 15x at 64k tokens); on the CPU it cannot, and says so."""
    model = make_model(device, dtype, seed=10)
    c = model.config
    # the probe runs the kernel once per layout (cached): before the spy, so only the forward's calls count
    reason = varlen_unavailable_reason(dtype, device, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    calls = []
    real = layers._varlen_attention
    monkeypatch.setattr(layers, "_varlen_attention", lambda *args: calls.append(1) or real(*args))
    packed, ids_1T, _ = packing(sequences(model, device, seed=11))
    with torch.no_grad():
        logits_1TV = model.forward_full(ids_1T, packed=packed).logits_BTV
    assert torch.isfinite(logits_1TV).all()
    if device.type == "cuda":
        assert reason is None, f"packed {dtype} attention falls back to SDPA here: {reason}"
        assert len(calls) == c.num_hidden_layers
    else:
        assert reason is not None and "CUDA" in reason and not calls


def test_packed_forward_matches_per_sequence_forwards(device, dtype):
    model = make_model(device, dtype, seed=20)
    seqs = sequences(model, device, seed=21)
    packed, ids_1T, _ = packing(seqs)
    with torch.no_grad():
        separate = [model.forward_full(s) for s in seqs]
        routes_1TLK = torch.cat([o.routed_experts_BTLK for o in separate], 1)
        out = model.forward_full(ids_1T, packed=packed, routed_experts_BTLK=routes_1TLK)
    errs = [rel_err(a, o.logits_BTV) for a, o in zip(packed.split(out.logits_BTV), separate, strict=True)]
    bad = [(s.shape[1], e) for s, e in zip(seqs, errs) if not e <= TOL[dtype]["logits"]]
    assert not bad, f"(length, rel. error) of the sequences over {TOL[dtype]['logits']}: {bad}"


def test_packed_loss_grads_match_sum_of_separate(device, dtype):
    model = make_model(device, dtype, seed=30)
    seqs = sequences(model, device, seed=31)
    packed, ids_1T, targets_1T = packing(seqs)
    with torch.no_grad():
        routes_1TLK = torch.cat([model.forward_full(s).routed_experts_BTLK for s in seqs], 1)
    sep_loss = sum(token_loss(model.forward_full(s, routed_experts_BTLK=r).logits_BTV, t)
                   for s, r, t in zip(seqs, packed.split(routes_1TLK), packed.split(targets_1T), strict=True))
    want = grads(model, sep_loss)
    logits_1TV = model.forward_full(ids_1T, packed=packed, routed_experts_BTLK=routes_1TLK).logits_BTV
    got = grads(model, token_loss(logits_1TV, targets_1T))
    err, name = worst(got, want)
    assert err <= TOL[dtype]["grads"], f"worst parameter gradient {name}: rel. error {err:.1e}"


@pytest.mark.parametrize("mode", [True, "selective"])
def test_activation_checkpointing_grads_match_none(device, dtype, mode):
    """Packed, own routing (no replay). The recompute must route exactly as the forward did (read off the routers:
    each called twice, the same top-k both times). Backward on CUDA is not bitwise reproducible (atomics in the
    attention and scatter backward kernels), so the gradients are held to the run-to-run noise of plain backward:
    4x the worst difference of two plain runs (a single sample of that noise), and 1e-6 where it is zero.
    Selective checkpointing is held to 1e-4: on the H200 in bf16 (2cb0def) it gave 1.9e-5 in one gradient (layer
    0's q_proj) where plain backward repeated bitwise; full checkpointing does repeat it bitwise. The cause is not
    found; a recompute that took another path (or a cached output mutated in place) would be off by far more."""
    model = make_model(device, dtype, seed=40)
    packed, ids_1T, targets_1T = packing(sequences(model, device, seed=41))

    def run(checkpointing) -> dict[str, torch.Tensor]:
        model.enable_activation_checkpointing(checkpointing)
        try:
            return grads(model, token_loss(model.forward_full(ids_1T, packed=packed).logits_BTV, targets_1T))
        finally:
            model.enable_activation_checkpointing(False)

    want = run(False)
    noise, _ = worst(run(False), want)
    seen: dict[int, list[torch.Tensor]] = {}
    hooks = [block.gate.register_forward_hook(lambda m, a, out, i=i: seen.setdefault(i, []).append(out.topk_idx_TK))
             for i, block in enumerate(model.moe_blocks)]
    try:
        got = run(mode)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == len(model.moe_blocks)
    assert all(len(v) == 2 and torch.equal(v[0], v[1]) for v in seen.values()), \
        f"router calls per MoE layer {[len(v) for v in seen.values()]}, or the recompute routed differently"
    err, name = worst(got, want)
    floor = 1e-4 if mode == "selective" else 1e-6
    assert err <= max(floor, 4 * noise), f"worst parameter gradient {name}: rel. error {err:.1e} (noise {noise:.1e})"
