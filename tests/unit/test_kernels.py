"""The torch reference paths of moerl.kernels and the permutation ops, against autograd in float64."""

import torch
import torch.nn.functional as F

from moerl.ep.permute import combine_weighted, expand_tokens
from moerl.kernels import swiglu


def test_swiglu_matches_autograd_float64():
    h = torch.randn(37, 2 * 24, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(swiglu, (h,))
    gate, up = h.detach().chunk(2, dim=-1)
    torch.testing.assert_close(swiglu(h), F.silu(gate) * up, rtol=0, atol=0)


def test_swiglu_empty_rows():
    h = torch.randn(0, 8, requires_grad=True)
    out = swiglu(h)
    out.sum().backward()
    assert out.shape == (0, 4) and h.grad.shape == (0, 8)


def test_permutation_ops_gradcheck_with_drops():
    gen = torch.Generator().manual_seed(0)
    T, K, D = 6, 3, 5
    for kept in (T * K, T * K - 4, 0):
        order = torch.randperm(T * K, generator=gen)[:kept]
        x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
        torch.autograd.gradcheck(lambda x: expand_tokens(x, order, K), (x,))
        y = torch.randn(kept, D, dtype=torch.float64, requires_grad=True)
        w = torch.randn(T, K, dtype=torch.float64, requires_grad=True)
        torch.autograd.gradcheck(lambda y, w: combine_weighted(y, order, w), (y, w))
        ref = torch.zeros(T, D, dtype=torch.float64)
        for n, m in enumerate(order.tolist()):
            ref[m // K] += w[m // K, m % K] * y[n]
        torch.testing.assert_close(combine_weighted(y, order, w), ref)


def test_expand_backward_is_bitwise_deterministic():
    T, K, D = 50, 4, 16
    order = torch.randperm(T * K)
    grads = []
    for _ in range(2):
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        expand_tokens(x, order, K).pow(2).sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
