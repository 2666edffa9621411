"""LocalDispatcher (the reference every EP backend is tested against) vs a dense float64 computation.

Dense reference: out[t] = sum_k [idx[t, k] >= 0] * w[t, k] * W[idx[t, k]] @ x[t], with a per-expert linear map W.
"""

from __future__ import annotations

import pytest
import torch

from moerl.ep.dispatcher import LocalDispatcher

E, K, D = 6, 2, 5


def make_case(T: int, seed: int = 0, drop_frac: float = 0.0, unused: tuple[int, ...] = ()):
    gen = torch.Generator().manual_seed(seed)
    avail = torch.tensor([e for e in range(E) if e not in unused])
    idx_TK = avail[torch.rand(T, len(avail), generator=gen).argsort(-1)[:, :K]]
    idx_TK = torch.where(torch.rand(T, K, generator=gen) < drop_frac, -1, idx_TK)
    x_TD = torch.randn(T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    w_TK = torch.rand(T, K, generator=gen, dtype=torch.float64, requires_grad=True)
    W_EDD = torch.randn(E, D, D, generator=gen, dtype=torch.float64, requires_grad=True)
    return x_TD, idx_TK, w_TK, W_EDD


def dense_reference(x_TD, idx_TK, w_TK, W_EDD):
    out_TD = torch.zeros_like(x_TD)
    for k in range(idx_TK.shape[1]):
        kept_T = idx_TK[:, k] >= 0
        y_TD = torch.einsum("tij,tj->ti", W_EDD[idx_TK[:, k].clamp(min=0)], x_TD)
        out_TD = out_TD + torch.where(kept_T[:, None], w_TK[:, k : k + 1] * y_TD, 0.0)
    return out_TD


def via_dispatcher(x_TD, idx_TK, w_TK, W_EDD, may_drop: bool):
    disp = LocalDispatcher(E)
    disp.may_drop = may_drop
    x_ND, counts_E, handle = disp.dispatch(x_TD, idx_TK, w_TK)
    expert_N = torch.repeat_interleave(torch.arange(E), counts_E, output_size=x_ND.shape[0])
    y_ND = torch.einsum("nij,nj->ni", W_EDD[expert_N], x_ND)
    return disp.combine(y_ND, handle), x_ND, counts_E


def grads(out_TD, cot_TD, *inputs):
    return torch.autograd.grad((out_TD * cot_TD).sum(), inputs, allow_unused=True)


CASES = {
    "dropless": dict(T=9),
    "drops": dict(T=11, drop_frac=0.3),
    "idle experts": dict(T=7, unused=(0, 3)),
    "drops and idle experts": dict(T=10, drop_frac=0.4, unused=(5,)),
    "one token": dict(T=1),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_dense_reference_and_gradients(case):
    x_TD, idx_TK, w_TK, W_EDD = make_case(**CASES[case])
    may_drop = bool((idx_TK < 0).any())
    got_TD, _, _ = via_dispatcher(x_TD, idx_TK, w_TK, W_EDD, may_drop)
    want_TD = dense_reference(x_TD, idx_TK, w_TK, W_EDD)
    torch.testing.assert_close(got_TD, want_TD)
    cot_TD = torch.randn_like(want_TD)
    for name, g, r in zip(("x", "weights", "experts"), grads(got_TD, cot_TD, x_TD, w_TK, W_EDD),
                          grads(want_TD, cot_TD, x_TD, w_TK, W_EDD)):
        torch.testing.assert_close(g, r, msg=lambda m: f"grad wrt {name}: {m}")


@pytest.mark.parametrize("case", ["dropless", "drops and idle experts"])
def test_gradcheck(case):
    x_TD, idx_TK, w_TK, W_EDD = make_case(**CASES[case])
    may_drop = bool((idx_TK < 0).any())
    assert torch.autograd.gradcheck(
        lambda x, w, W: via_dispatcher(x, idx_TK, w, W, may_drop)[0], (x_TD, w_TK, W_EDD)
    )


def test_dropped_pairs_contribute_zero():
    x_TD, idx_TK, w_TK, W_EDD = make_case(T=12, seed=3, drop_frac=0.4)
    dropped_TK = idx_TK < 0
    assert dropped_TK.any() and not dropped_TK.all()
    got_TD, x_ND, counts_E = via_dispatcher(x_TD, idx_TK, w_TK, W_EDD, may_drop=True)
    assert x_ND.shape[0] == int((~dropped_TK).sum()) == int(counts_E.sum())  # dropped pairs are not sent
    # Any value at a dropped slot's expert id or weight gives the same result.
    other_idx_TK = torch.where(dropped_TK, (idx_TK + 1) % E, idx_TK)  # would be routed if not marked -1
    without_TD = dense_reference(x_TD, torch.where(dropped_TK, -1, other_idx_TK), w_TK, W_EDD)
    torch.testing.assert_close(got_TD, without_TD)
    (g_w,) = grads(got_TD, torch.randn_like(got_TD), w_TK)
    assert torch.all(g_w[dropped_TK] == 0) and torch.all(g_w[~dropped_TK] != 0)


def test_rows_grouped_by_expert_in_token_order():
    x_TD, idx_TK, w_TK, W_EDD = make_case(T=8, seed=5, unused=(2,))
    _, x_ND, counts_E = via_dispatcher(x_TD, idx_TK, w_TK, W_EDD, may_drop=False)
    assert counts_E.tolist() == [int((idx_TK == e).sum()) for e in range(E)] and counts_E[2] == 0
    for e, rows_nD in enumerate(torch.split(x_ND, counts_E.tolist())):
        tokens = [t for t in range(idx_TK.shape[0]) if (idx_TK[t] == e).any()]
        torch.testing.assert_close(rows_nD, x_TD[tokens], rtol=0, atol=0)


def test_idle_experts_get_zero_gradient():
    x_TD, idx_TK, w_TK, W_EDD = make_case(T=6, seed=1, unused=(1, 4))
    got_TD, _, counts_E = via_dispatcher(x_TD, idx_TK, w_TK, W_EDD, may_drop=False)
    assert counts_E[1] == counts_E[4] == 0
    (g_W,) = grads(got_TD, torch.randn_like(got_TD), W_EDD)
    assert torch.all(g_W[[1, 4]] == 0) and torch.all(g_W[[0, 2, 3, 5]].abs().sum((1, 2)) > 0)


@pytest.mark.parametrize("may_drop", [False, True])
def test_zero_tokens(may_drop):
    x_TD, idx_TK, w_TK, W_EDD = make_case(T=0)
    got_TD, x_ND, counts_E = via_dispatcher(x_TD, idx_TK, w_TK, W_EDD, may_drop)
    assert got_TD.shape == (0, D) and x_ND.shape == (0, D) and counts_E.tolist() == [0] * E
    g_x, g_w, g_W = grads(got_TD, torch.randn_like(got_TD), x_TD, w_TK, W_EDD)
    assert g_x.shape == (0, D) and g_w.shape == (0, K)
    assert g_W is None or torch.all(g_W == 0)
