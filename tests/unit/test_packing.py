"""Packed variable-length sequences in the model's forward, hidden-only output, activation checkpointing.

Float32 on CPU, so packed attention takes the SDPA block-mask path; the flash varlen path's layout code is
checked here against a stand-in kernel (the real kernel: tests/gpu/test_varlen_gpu.py on a CUDA host).
"""

from __future__ import annotations

import collections
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from moerl.model import MoEModelConfig, build_model, layers, transformer
from moerl.model.packing import PackedSeqs
from tests.unit.test_moe_block import sharpen_routers_
from tests.unit.test_moe_block import small_config as moe_block_config

LENGTHS = [[5, 11, 1, 8], [7, 3, 9], [16], [20, 1, 2, 1]]  # the last: the block mask (padding costs more)


def small_config(**overrides) -> MoEModelConfig:
    # Three layers, the middle one dense, so both block kinds are packed and checkpointed.
    return moe_block_config(**{"num_hidden_layers": 3, "mlp_only_layers": [1], **overrides})


def small_model(seed: int = 0, **overrides):
    model = build_model(small_config(**overrides), seed=seed)
    sharpen_routers_(model, seed)
    return model


def sequences(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (1, n), generator=gen) for n in lengths]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------------
# PackedSeqs


def test_packed_seqs_helpers():
    packed = PackedSeqs.from_lengths([3, 1, 2])
    assert packed.cu_seqlens_S1.dtype == torch.int32 and packed.cu_seqlens_S1.tolist() == [0, 3, 4, 6]
    assert (packed.max_len, packed.total_len, packed.num_seqs, packed.lengths()) == (3, 6, 3, [3, 1, 2])
    assert packed.position_ids().tolist() == [[0, 1, 2, 0, 0, 1]]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for start, n in ((0, 3), (3, 1), (4, 2)):
        expected[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
    mask = packed.causal_block_mask()
    assert mask.shape == (1, 1, 6, 6) and torch.equal(mask[0, 0], expected)
    xs = sequences([3, 1, 2])
    assert [torch.equal(a, b) for a, b in zip(packed.split(PackedSeqs.pack(xs)), xs)] == [True] * 3
    # total_len is read from cu_seqlens when not given.
    assert PackedSeqs(packed.cu_seqlens_S1, 3).total_len == 6


def test_padded_index_and_the_fallback_choice():
    packed = PackedSeqs.from_lengths([3, 1, 2]).with_padded_index()
    assert packed.padded.gather_SP.tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 5]]  # padding repeats the last
    assert packed.padded.scatter_T.tolist() == [0, 1, 2, 3, 6, 7]
    assert packed.padded.to("cpu").gather_SP.equal(packed.to("cpu").padded.gather_SP)
    assert PackedSeqs.from_lengths([3, 1, 2]).padded is None
    # causal SDPA on [S, P] costs S P^2, the block mask T^2: padding unless one sequence dwarfs the rest
    assert [PackedSeqs.from_lengths(n).padding_is_cheaper() for n in LENGTHS] == [True, True, True, False]


@pytest.mark.parametrize("lengths", [LENGTHS[0], LENGTHS[3]])
def test_padded_and_mask_paths_compute_the_same_attention(lengths, monkeypatch):
    model, seqs = small_model(), sequences(lengths)
    ids, packed = PackedSeqs.pack(seqs), PackedSeqs.from_lengths(lengths)
    with torch.no_grad():
        auto = model(ids, packed=packed)
        cheaper = PackedSeqs.padding_is_cheaper
        monkeypatch.setattr(PackedSeqs, "padding_is_cheaper", lambda self: not cheaper(self))  # the other path
        other = model(ids, packed=packed)
    torch.testing.assert_close(other, auto, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lengths", [[], [3, 0, 2], [-1]])
def test_packed_seqs_rejects_bad_lengths(lengths):
    with pytest.raises(ValueError, match="length"):
        PackedSeqs.from_lengths(lengths)


def test_packed_seqs_rejects_bad_cu_seqlens():
    with pytest.raises(ValueError, match="int32"):
        PackedSeqs(torch.tensor([0, 3, 5]), 3)


# ---------------------------------------------------------------------------------------------------
# Task 1: packed forward equals the separate forwards


@pytest.mark.parametrize("lengths", LENGTHS)
def test_packed_logits_equal_separate_forwards(lengths):
    model = small_model()
    seqs = sequences(lengths)
    with torch.no_grad():
        separate = [model.forward_full(s) for s in seqs]
        out = model.forward_full(PackedSeqs.pack(seqs), packed=PackedSeqs.from_lengths(lengths))
    want = torch.cat([o.logits_BTV for o in separate], 1)
    torch.testing.assert_close(out.logits_BTV, want, rtol=0, atol=1e-5)
    assert torch.equal(out.routed_experts_BTLK, torch.cat([o.routed_experts_BTLK for o in separate], 1))
    assert torch.equal(out.expert_counts_LE, sum(o.expert_counts_LE for o in separate))


def test_packed_routing_replay_equals_separate_replay():
    lengths = LENGTHS[0]
    model, seqs = small_model(), sequences(lengths)
    with torch.no_grad():
        routes = [model.forward_full(s).routed_experts_BTLK for s in seqs]
        sharpen_routers_(model, seed=1)  # a policy whose own choices differ: replay must override them
        own = model.forward_full(PackedSeqs.pack(seqs), packed=PackedSeqs.from_lengths(lengths))
        separate = [model.forward_full(s, routed_experts_BTLK=r) for s, r in zip(seqs, routes)]
        replay_1TLK = torch.cat(routes, 1)
        out = model.forward_full(PackedSeqs.pack(seqs), packed=PackedSeqs.from_lengths(lengths),
                                 routed_experts_BTLK=replay_1TLK)
    assert not torch.equal(own.routed_experts_BTLK, replay_1TLK)
    assert torch.equal(out.routed_experts_BTLK, replay_1TLK)
    torch.testing.assert_close(out.logits_BTV, torch.cat([o.logits_BTV for o in separate], 1), rtol=0, atol=1e-5)


def grads_of(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("lengths", [LENGTHS[0], LENGTHS[3]])  # padded SDPA, block mask
def test_packed_gradients_equal_sum_of_separate(replay, lengths):
    model, seqs = small_model(), sequences(lengths)
    with torch.no_grad():
        routes = [model.forward_full(s).routed_experts_BTLK for s in seqs]
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(1, n, 64, generator=gen) for n in lengths]  # a loss that touches every logit

    separate = sum(
        (model.forward_full(s, routed_experts_BTLK=r if replay else None).logits_BTV * w).sum()
        for s, r, w in zip(seqs, routes, weights)
    )
    want = grads_of(model, separate)
    packed = PackedSeqs.from_lengths(lengths)
    logits = model.forward_full(PackedSeqs.pack(seqs), packed=packed,
                                routed_experts_BTLK=torch.cat(routes, 1) if replay else None).logits_BTV
    got = grads_of(model, sum((l * w).sum() for l, w in zip(packed.split(logits), weights)))
    assert got.keys() == want.keys() and len(got) == len(list(model.parameters()))
    for name in want:
        assert rel_err(got[name], want[name]) < 1e-5, name


def test_hidden_only_projects_to_the_same_logits():
    lengths = LENGTHS[1]
    model, seqs = small_model(), sequences(lengths)
    packed = PackedSeqs.from_lengths(lengths)
    with torch.no_grad():
        full = model.forward_full(PackedSeqs.pack(seqs), packed=packed)
        hid = model.forward_full(PackedSeqs.pack(seqs), packed=packed, hidden_only=True)
        plain = model.forward_full(seqs[0], hidden_only=True)
    assert hid.logits_BTV is None and full.hidden_BTD is None
    assert hid.hidden_BTD.shape == (1, sum(lengths), 32)
    torch.testing.assert_close(model.lm_head(hid.hidden_BTD), full.logits_BTV, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head(plain.hidden_BTD), model(seqs[0]), rtol=0, atol=0)
    assert torch.equal(hid.routed_experts_BTLK, full.routed_experts_BTLK)


def test_packed_input_mismatches_raise():
    model = small_model()
    packed = PackedSeqs.from_lengths([3, 4])
    with pytest.raises(ValueError, match="batch size 2"):
        model.forward_full(torch.zeros(2, 7, dtype=torch.long), packed=packed)
    with pytest.raises(ValueError, match="8 positions but its cu_seqlens add up to 7"):
        model.forward_full(torch.zeros(1, 8, dtype=torch.long), packed=packed)
    with pytest.raises(ValueError, match="attn_mask"):
        model.forward_full(torch.zeros(1, 7, dtype=torch.long), packed=packed, attn_mask=packed.causal_block_mask())
    with pytest.raises(ValueError, match="routed_experts"):
        model.forward_full(torch.zeros(1, 7, dtype=torch.long), packed=packed,
                           routed_experts_BTLK=torch.zeros(1, 6, 2, 2, dtype=torch.long))


def test_packed_attention_path_on_cpu_is_the_mask():
    reason = layers.varlen_unavailable_reason(torch.float32, "cpu", 4, 2, 8)
    assert reason is not None and "CUDA" in reason


FAKE_CALLS: list[str] = []


def fake_varlen_new(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False, **_):
    """torch >= 2.11's keywords, computed per sequence with SDPA."""
    FAKE_CALLS.append("new")
    assert enable_gqa and window_size == (-1, 0) and cu_q is cu_k and max_q == max_k == int(cu_q.diff().max())
    return _per_sequence(q, k, v, cu_q, enable_gqa)


def fake_varlen_old(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's keywords: is_causal, no enable_gqa (keys/values must come with every query head)."""
    FAKE_CALLS.append("old")
    assert is_causal and k.shape[1] == q.shape[1]
    return _per_sequence(q, k, v, cu_q, False)


def _per_sequence(q_THd, k_TGd, v_TGd, cu_S1, gqa):
    bounds = cu_S1.tolist()
    outs = [
        F.scaled_dot_product_attention(q_THd[a:b].transpose(0, 1), k_TGd[a:b].transpose(0, 1),
                                       v_TGd[a:b].transpose(0, 1), is_causal=True, enable_gqa=gqa).transpose(0, 1)
        for a, b in pairwise(bounds)
    ]
    return torch.cat(outs)


@pytest.mark.parametrize("fake", [fake_varlen_new, fake_varlen_old])
def test_varlen_path_layout_with_stand_in_kernel(fake, monkeypatch):
    """The [T, heads, d] layout, rotary there and the GQA handling of both torch spellings, on CPU."""
    lengths = LENGTHS[0]
    model, seqs = small_model(), sequences(lengths)
    with torch.no_grad():
        want = torch.cat([model(s) for s in seqs], 1)
    layers._varlen_kernel.cache_clear()
    FAKE_CALLS.clear()
    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", fake)
    monkeypatch.setattr(transformer, "varlen_unavailable_reason", lambda *a: None)
    try:
        with torch.no_grad():
            got = model(PackedSeqs.pack(seqs), packed=PackedSeqs.from_lengths(lengths))
    finally:
        layers._varlen_kernel.cache_clear()
    assert len(FAKE_CALLS) == 3  # once per decoder layer
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Task 2: activation checkpointing


def training_loss(model, replay: bool, packed: bool, seed: int = 0):
    lengths = LENGTHS[0]
    seqs = sequences(lengths, seed)
    kw = {}
    if packed:
        ids, kw["packed"] = PackedSeqs.pack(seqs), PackedSeqs.from_lengths(lengths)
    else:
        ids = torch.cat([s[:, :5] for s in seqs if s.shape[1] >= 5])  # a plain [B, T] batch
    if replay:
        with torch.no_grad():
            kw["routed_experts_BTLK"] = model.forward_full(ids, **kw).routed_experts_BTLK
            sharpen_routers_(model, seed=1)
    out = model.forward_full(ids, with_aux_loss=True, **kw)
    w = torch.randn(out.logits_BTV.shape, generator=torch.Generator().manual_seed(7))
    return (out.logits_BTV * w).sum() + 0.1 * out.aux_loss, out


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_checkpointing_gives_the_same_gradients(replay, packed):
    model = small_model()
    loss_off, out_off = training_loss(model, replay, packed)
    want = grads_of(model, loss_off)
    model = small_model()
    model.enable_activation_checkpointing()
    loss_on, out_on = training_loss(model, replay, packed)
    got = grads_of(model, loss_on)
    assert torch.equal(loss_on, loss_off)
    assert torch.equal(out_on.routed_experts_BTLK, out_off.routed_experts_BTLK)
    assert torch.equal(out_on.expert_counts_LE, out_off.expert_counts_LE)
    assert got.keys() == want.keys() and len(got) == len(list(model.parameters()))
    for name in want:  # the recompute runs the same kernels on the same inputs: bitwise equal
        assert torch.equal(got[name], want[name]), (name, rel_err(got[name], want[name]))
    # The routers get gradient from the aux loss and the mixing weights, through the recompute too.
    assert all(block.gate.weight.grad.abs().sum() > 0 for block in model.moe_blocks)


def test_checkpoint_recompute_routes_as_the_forward():
    """Read off the routers: each MoE layer routes twice (forward, recompute in backward), identically."""
    model = small_model()
    model.enable_activation_checkpointing()
    seen: dict[int, list[torch.Tensor]] = {}
    for i, block in enumerate(model.moe_blocks):
        block.gate.register_forward_hook(lambda m, a, out, i=i: seen.setdefault(i, []).append(out.topk_idx_TK))
    loss, _ = training_loss(model, replay=False, packed=True)
    assert [len(v) for v in seen.values()] == [1, 1]
    loss.backward()
    assert [len(v) for v in seen.values()] == [2, 2]
    assert all(torch.equal(v[0], v[1]) for v in seen.values())


def saved_bytes(model, packed: bool) -> tuple[int, int]:
    count, nbytes = 0, 0

    def pack(t: torch.Tensor):
        nonlocal count, nbytes
        count, nbytes = count + 1, nbytes + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = training_loss(model, replay=False, packed=packed)
    loss.backward()
    return count, nbytes


@pytest.mark.parametrize("packed", [False, True])
def test_checkpointing_saves_fewer_tensors(packed):
    model = small_model()
    count_off, bytes_off = saved_bytes(model, packed)
    model.enable_activation_checkpointing()
    count_on, bytes_on = saved_bytes(model, packed)
    # With it on only the embedding, final norm and lm_head save tensors outside the layers.
    assert count_on < count_off / 3 and bytes_on < bytes_off / 2, (count_on, count_off, bytes_on, bytes_off)


def backward_op_counts(model, mode) -> collections.Counter:
    """aten ops run during backward (recompute included), by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    model.enable_activation_checkpointing(mode)
    loss, _ = training_loss(model, replay=False, packed=True)
    with Count() as counter:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.ops


def test_selective_checkpointing_recomputes_no_gemm():
    """Selective: backward runs the GEMMs that plain backward runs (their outputs were kept), while full
    checkpointing runs the forward's GEMMs again; both re-run the norms (rsqrt), plain backward does not.
    A bad mode is refused in one line."""
    model = small_model()
    plain, full, selective = (backward_op_counts(model, m) for m in (False, True, "selective"))
    gemms = ("aten.mm", "aten._grouped_mm", "aten.bmm", "aten.addmm")
    assert sum(full[g] for g in gemms) > sum(plain[g] for g in gemms) == sum(selective[g] for g in gemms)
    assert plain["aten.rsqrt"] == 0 and selective["aten.rsqrt"] == full["aten.rsqrt"] > 0
    with pytest.raises(ValueError, match="selective"):
        model.enable_activation_checkpointing("partial")


def test_checkpointing_is_off_without_grad_and_with_flag_off():
    model = small_model()
    model.enable_activation_checkpointing()
    assert model.activation_checkpointing
    seqs = sequences([6])
    with torch.no_grad():
        on = model(seqs[0])
    model.enable_activation_checkpointing(False)
    with torch.no_grad():
        off = model(seqs[0])
    assert not model.activation_checkpointing and torch.equal(on, off)
