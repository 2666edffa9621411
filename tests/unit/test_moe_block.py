"""The sparse MoE block: grouped experts, router (replay, expert bias, aux loss), capacity, statistics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moerl.model import MoEModelConfig, build_model
from moerl.model.moe import GroupedExperts, SparseMoEBlock, TopKRouter, apply_capacity, grouped_mm_available


def small_config(**overrides) -> MoEModelConfig:
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)
    kw.update(overrides)
    return MoEModelConfig(**kw)


@torch.no_grad()
def sharpen_routers_(model, seed: int = 0, std: float = 0.1) -> None:
    """Routers with std 0.1 instead of 0.02: clear top-k margins, so tiny float noise never flips a choice."""
    gen = torch.Generator().manual_seed(seed)
    for block in model.moe_blocks:
        block.gate.weight.copy_(std * torch.randn(block.gate.weight.shape, generator=gen))


def small_model(dtype=torch.float32, seed: int = 0, **overrides):
    model = build_model(small_config(**overrides), dtype=dtype, seed=seed)
    sharpen_routers_(model, seed)
    return model


def ids(B: int = 2, T: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def random_experts(num_experts: int, D: int, I: int, impl: str, seed: int = 0) -> GroupedExperts:
    experts = GroupedExperts(num_experts, D, I, impl=impl)
    gen = torch.Generator().manual_seed(seed)
    for p in (experts.gate_up_proj, experts.down_proj):
        p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return experts


def router_by_hand(x_TD: torch.Tensor, weight_ED: torch.Tensor, top_k: int):
    probs_TE = torch.softmax(x_TD.float() @ weight_ED.float().T, dim=-1)
    return probs_TE, torch.topk(probs_TE, top_k, dim=-1).indices


# ---------------------------------------------------------------------------------------------------
# GroupedExperts


@pytest.mark.parametrize("counts", [[3, 0, 5, 0, 0, 4], [0, 2, 0, 7, 1, 0], [0, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0]])
def test_grouped_mm_equals_loop_forward_and_backward(counts):
    counts_L = torch.tensor(counts)
    N = sum(counts)
    grouped = random_experts(6, 32, 16, "grouped_mm")
    loop = random_experts(6, 32, 16, "loop")
    x = torch.randn(N, 32, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(N, 32, generator=torch.Generator().manual_seed(2))
    xg, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    yg, yl = grouped(xg, counts_L), loop(xl, counts_L)
    assert yg.shape == yl.shape == (N, 32)
    torch.testing.assert_close(yg, yl, rtol=1e-5, atol=1e-6)
    (yg * grad_out).sum().backward()
    (yl * grad_out).sum().backward()
    if N:
        torch.testing.assert_close(xg.grad, xl.grad, rtol=1e-5, atol=1e-6)
    for name in ("gate_up_proj", "down_proj"):
        g_grad, l_grad = getattr(grouped, name).grad, getattr(loop, name).grad
        torch.testing.assert_close(g_grad, l_grad, rtol=1e-5, atol=1e-6)
        for e, c in enumerate(counts):  # an expert with no rows gets an exact zero gradient (no garbage)
            if c == 0:
                assert (g_grad[e] == 0).all() and (l_grad[e] == 0).all()
            else:
                assert g_grad[e].abs().sum() > 0


def test_loop_ignores_padding_rows_past_the_counts():
    """Backends may send more rows than counts_L covers; the loop must not choke on them."""
    counts_L = torch.tensor([2, 0, 3, 1])
    loop = random_experts(4, 16, 8, "loop")
    x = torch.randn(9, 16)
    y = loop(x, counts_L)
    assert y.shape == (9, 16)
    torch.testing.assert_close(y[:6], random_experts(4, 16, 8, "grouped_mm")(x[:6], counts_L))
    assert (y[6:] == 0).all()


def test_auto_falls_back_to_loop_when_grouped_mm_cannot_run():
    """torch._grouped_mm needs 16-byte rows; intermediate 6 (24 bytes in fp32) goes to the loop in 'auto'."""
    counts_L = torch.tensor([2, 0, 3, 1])
    x = torch.randn(6, 16)
    auto = random_experts(4, 16, 6, "auto")
    torch.testing.assert_close(auto(x, counts_L), random_experts(4, 16, 6, "loop")(x, counts_L))


def test_float64_model_uses_loop_and_matches_float32(monkeypatch):
    calls = []
    original = GroupedExperts._loop
    monkeypatch.setattr(GroupedExperts, "_loop", lambda self, *a: calls.append(1) or original(self, *a))
    m64 = small_model(torch.float64, seed=3)
    m32 = small_model(torch.float32, seed=3)
    assert not grouped_mm_available(torch.zeros(1, dtype=torch.float64))
    with torch.no_grad():
        o64 = m64.forward_full(ids())
        assert len(calls) == m64.num_moe_layers  # every MoE layer ran the loop fallback
        o32 = m32.forward_full(ids())
    assert o64.logits_BTV.dtype == torch.float64
    assert torch.equal(o64.routed_experts_BTLK, o32.routed_experts_BTLK)
    ref = o32.logits_BTV.double()
    assert ((o64.logits_BTV - ref).abs().max() / ref.abs().max()).item() < 1e-6


# ---------------------------------------------------------------------------------------------------
# Routing replay


def test_replay_of_recorded_routing_reproduces_logits_exactly():
    model = small_model(seed=1)
    with torch.no_grad():
        first = model.forward_full(ids())
        again = model.forward_full(ids(), routed_experts_BTLK=first.routed_experts_BTLK)
    assert first.routed_experts_BTLK.shape == (2, 9, 2, 2)
    assert torch.equal(again.logits_BTV, first.logits_BTV)
    assert torch.equal(again.routed_experts_BTLK, first.routed_experts_BTLK)


def test_replay_of_other_experts_changes_outputs_and_router_still_learns():
    model = small_model(seed=2)
    with torch.no_grad():
        first = model.forward_full(ids())
    other = (first.routed_experts_BTLK + 1) % model.config.num_experts  # still K distinct experts per token
    out = model.forward_full(ids(), routed_experts_BTLK=other)
    assert torch.equal(out.routed_experts_BTLK, other)
    assert not torch.allclose(out.logits_BTV, first.logits_BTV, atol=1e-4)
    F.cross_entropy(out.logits_BTV[:, :-1].reshape(-1, 64), ids()[:, 1:].reshape(-1)).backward()
    for block in model.moe_blocks:
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_replay_weights_are_the_probabilities_of_the_replayed_experts():
    config = small_config(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    router = TopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.3)
    x = torch.randn(5, 32)
    replay = torch.tensor([[3, 0], [1, 2], [0, 1], [2, 3], [3, 1]])
    out = router(x, replay)
    probs, _ = router_by_hand(x, router.weight, 2)
    assert torch.equal(out.topk_idx_TK, replay)
    torch.testing.assert_close(out.topk_weights_TK, probs.gather(1, replay))


def test_replay_with_wrong_shape_names_the_expected_shape():
    model = small_model()
    with torch.no_grad():
        routed = model.forward_full(ids()).routed_experts_BTLK
    with pytest.raises(ValueError, match=r"\[2, 9, 2, 2\]"):
        model.forward_full(ids(), routed_experts_BTLK=routed[..., :1])
    with pytest.raises(ValueError, match=r"\[2, 9, 2, 2\]"):
        model.forward_full(ids(), routed_experts_BTLK=routed[:, :5])
    router = model.moe_blocks[0].gate
    with pytest.raises(ValueError, match=r"tokens=18, top_k=2"):
        router(torch.randn(18, 32), torch.zeros(18, 3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------
# Load-balancing aux loss


def test_aux_loss_is_positive_differentiable_and_equals_the_formula():
    model = small_model(seed=4)
    inputs = []
    hooks = [b.gate.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach())) for b in model.moe_blocks]
    out = model.forward_full(ids(), with_aux_loss=True)
    for h in hooks:
        h.remove()
    E, K = model.config.num_experts, model.config.num_experts_per_tok
    by_hand = []
    for block, x_TD in zip(model.moe_blocks, inputs):
        probs_TE, idx_TK = router_by_hand(x_TD, block.gate.weight.detach(), K)
        f_E = torch.bincount(idx_TK.reshape(-1), minlength=E).float() / idx_TK.numel()  # fraction of (token, slot) pairs
        by_hand.append(E * torch.sum(f_E * probs_TE.mean(0)))
    assert out.aux_loss is not None and out.aux_loss.ndim == 0
    assert out.aux_loss.item() > 0
    torch.testing.assert_close(out.aux_loss, torch.stack(by_hand).mean())
    out.aux_loss.backward()
    for block in model.moe_blocks:
        assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    assert model.forward_full(ids()).aux_loss is None  # only when asked for


def test_aux_loss_of_perfectly_balanced_uniform_router_is_one():
    config = small_config(num_experts=4, num_experts_per_tok=2)
    router = TopKRouter(config)  # zero weights: uniform probabilities
    out = router(torch.randn(8, 32), torch.tensor([[0, 1], [2, 3]] * 4), with_aux_loss=True)
    torch.testing.assert_close(out.aux_loss, torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------------
# Aux-loss-free expert bias


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_expert_bias_changes_choice_not_weight_formula(norm_topk_prob):
    config = small_config(num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    router = TopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.3)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    probs, plain_idx = router_by_hand(x, router.weight, 2)
    assert torch.equal(router(x).topk_idx_TK, plain_idx)
    assert not (plain_idx == 3).any(dim=1).all()  # without the bias, expert 3 is not everyone's pick

    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    router.bias_enabled = True
    out = router(x)
    assert (out.topk_idx_TK[:, 0] == 3).all()  # the bias decides the choice...
    expected = probs.gather(1, out.topk_idx_TK)  # ...but the weights are still the chosen experts' probabilities
    if norm_topk_prob:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(out.topk_weights_TK, expected)
    assert (out.topk_weights_TK < 1).all()


def test_update_expert_bias_moves_toward_balance():
    config = small_config(num_experts=4)
    router = TopKRouter(config)
    assert not router.bias_enabled
    router.update_expert_bias(torch.tensor([10, 0, 5, 5]), rate=0.01)
    assert router.bias_enabled
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))  # under-loaded: +rate
    assert router.expert_bias.dtype == torch.float32

    # A skewed router (expert 0 hot, expert 2 starved) balances out under repeated updates.
    with torch.no_grad():
        router.expert_bias.zero_()
        router.weight.copy_(0.3 * torch.randn(4, 32, generator=torch.Generator().manual_seed(1)))
        router.weight[0] += 0.2
    router.bias_enabled = False
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(2)) + 0.5
    start = router(x).counts_E
    assert start.max() - start.min() > 150
    for _ in range(200):
        router.update_expert_bias(router(x).counts_E, rate=0.01)
    end = router(x).counts_E
    assert start.sum() == end.sum() == 256 * 2
    assert end.max() - end.min() < 20  # perfect balance is 128 each
    assert router.expert_bias[start.argmax()] < 0 < router.expert_bias[start.argmin()]


def test_enable_expert_bias_turns_on_every_router():
    model = small_model()
    model.enable_expert_bias()
    assert all(b.gate.bias_enabled for b in model.moe_blocks)
    assert all(b.gate.expert_bias.dtype == torch.float32 for b in model.moe_blocks)
    keys = [k for k in model.state_dict() if k.endswith("gate.expert_bias")]
    assert len(keys) == model.num_moe_layers  # persistent: trainer checkpoints keep it


def test_expert_bias_stays_float32_in_bf16_model():
    model = small_model(torch.bfloat16)
    block = model.moe_blocks[0]
    assert block.gate.expert_bias.dtype == torch.float32
    block.gate.update_expert_bias(torch.tensor([1, 1, 1, 1, 1, 0]), rate=1e-3)
    for _ in range(299):
        block.gate.update_expert_bias(torch.tensor([1, 1, 1, 1, 1, 0]), rate=1e-3)
    torch.testing.assert_close(block.gate.expert_bias[5], torch.tensor(0.3))  # bf16 would stall near 0.25


# ---------------------------------------------------------------------------------------------------
# Capacity


def capacity_by_hand(idx_TK: torch.Tensor, num_experts: int, factor: float) -> torch.Tensor:
    capacity = math.ceil(factor * idx_TK.numel() / num_experts)
    seen = [0] * num_experts
    out = idx_TK.clone()
    for t in range(idx_TK.shape[0]):
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            out[t, k] = e if seen[e] < capacity else -1
            seen[e] += 1
    return out


def test_apply_capacity_drops_exactly_the_pairs_past_capacity():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3], [0, 1], [2, 3]])  # capacity ceil(12/4) = 3
    expected = torch.tensor([[0, 1], [0, 2], [0, 1], [-1, 3], [-1, 1], [2, 3]])
    assert torch.equal(apply_capacity(idx, 4, 1.0), expected)


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25, 4.0])
def test_apply_capacity_matches_reference_on_random_routing(factor):
    gen = torch.Generator().manual_seed(int(factor * 100))
    idx = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(40)])
    idx[:20, 0] = 0  # a hot expert
    assert torch.equal(apply_capacity(idx, 6, factor), capacity_by_hand(idx, 6, factor))


def test_block_output_is_zero_for_a_token_with_every_pair_dropped():
    config = small_config(num_experts=4, num_experts_per_tok=2)
    gen = torch.Generator().manual_seed(0)
    dropless = SparseMoEBlock(config, experts_impl="loop")
    capped = SparseMoEBlock(config, capacity_factor=1.0, experts_impl="loop")
    with torch.no_grad():
        for p in dropless.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    capped.load_state_dict(dropless.state_dict())
    x = torch.randn(8, 32, generator=gen)
    replay = torch.tensor([[0, 1]] * 8)  # 16 pairs on experts 0 and 1; capacity ceil(16/4) = 4 each
    full, cut = dropless(x, replay), capped(x, replay)
    assert torch.equal(cut.topk_idx_TK, replay)  # the router's (replayed) choice is what gets recorded
    assert (full.out_TD[4:].abs() > 0).any(dim=1).all()
    assert torch.equal(cut.out_TD[4:], torch.zeros(4, 32))  # tokens 4..7: all pairs past capacity
    torch.testing.assert_close(cut.out_TD[:4], full.out_TD[:4])


def test_model_with_capacity_runs_and_drops():
    model = build_model(small_config(), capacity_factor=0.5)
    sharpen_routers_(model)
    with torch.no_grad():
        capped = model.forward_full(ids())
    ref = small_model()
    with torch.no_grad():
        free = ref.forward_full(ids())
    assert torch.equal(capped.routed_experts_BTLK[:, :, 0], free.routed_experts_BTLK[:, :, 0])
    assert not torch.allclose(capped.logits_BTV, free.logits_BTV)


# ---------------------------------------------------------------------------------------------------
# Statistics


def test_expert_counts_sum_to_tokens_times_top_k():
    model = small_model(seed=5, num_hidden_layers=3, decoder_sparse_step=1, mlp_only_layers=[1])
    with torch.no_grad():
        out = model.forward_full(ids(B=3, T=7))
    L, E, K = model.num_moe_layers, model.config.num_experts, model.config.num_experts_per_tok
    assert L == 2
    assert out.expert_counts_LE.shape == (L, E) and out.expert_counts_LE.dtype == torch.int64
    assert (out.expert_counts_LE.sum(1) == 3 * 7 * K).all()
    for layer in range(L):
        expected = torch.bincount(out.routed_experts_BTLK[:, :, layer].reshape(-1), minlength=E)
        assert torch.equal(out.expert_counts_LE[layer], expected)


def test_model_without_moe_layers_returns_empty_routing():
    model = small_model(num_hidden_layers=2, mlp_only_layers=[0, 1])
    with torch.no_grad():
        out = model.forward_full(ids())
    assert out.routed_experts_BTLK.shape == (2, 9, 0, 2)
    assert out.expert_counts_LE.shape == (0, 6)
    assert out.aux_loss is None
