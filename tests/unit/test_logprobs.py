"""Chunked token log-probs / entropy: values and grads equal the naive full-softmax computation, and backward
saves nothing of N x V.

Shape legend: B sequences, T positions, N = B*T tokens, D hidden size, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from moerl.model.logprobs import chunked_token_logprobs, default_chunk_tokens


def naive(hidden: torch.Tensor, weight_VD: torch.Tensor, target: torch.Tensor, temperature: float = 1.0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The computation being replaced: full logits, full log_softmax, gather; entropy from the full softmax."""
    logp_NV = torch.log_softmax((hidden @ weight_VD.T).to(torch.promote_types(hidden.dtype, torch.float32))
                                / temperature, dim=-1)
    entropy = -(logp_NV.exp() * logp_NV).sum(-1)
    return logp_NV.gather(-1, target[..., None]).squeeze(-1), entropy


def make(shape: tuple[int, ...], D: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, D, generator=g, dtype=dtype).requires_grad_(True)
    weight_VD = (torch.randn(V, D, generator=g, dtype=dtype) * 2 / D**0.5).requires_grad_(True)
    target = torch.randint(0, V, shape, generator=g)
    g_logp = torch.randn(shape, generator=g, dtype=dtype)
    g_ent = torch.randn(shape, generator=g, dtype=dtype)
    return hidden, weight_VD, target, g_logp, g_ent


def assert_rel(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """Relative error of the norm within tol; in float64 also elementwise (fp32 elements near zero carry the
    summation-order noise of the different GEMM shapes, ~1e-5 relative, while the norm stays ~1e-7)."""
    assert a.shape == b.shape
    err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()
    assert err <= tol, f"relative error {err:.3g} > {tol:g}"
    if a.dtype == b.dtype == torch.float64:
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def values_and_grads(fn, hidden, weight_VD, g_logp, g_ent, with_entropy):
    hidden.grad = weight_VD.grad = None
    logp, ent = fn()
    loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if with_entropy else 0)
    loss.backward()
    return [logp.detach(), *([ent.detach()] if with_entropy else []), hidden.grad, weight_VD.grad]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("chunk", [1, 7, "N", None])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive(dtype, tol, chunk, with_entropy, temperature):
    shape, D, V = (3, 11), 16, 50  # [B, T, D] input: 33 tokens, not a multiple of 7
    hidden, weight_VD, target, g_logp, g_ent = make(shape, D, V, dtype)
    chunk_tokens = 33 if chunk == "N" else chunk
    got = values_and_grads(lambda: chunked_token_logprobs(hidden, weight_VD, target, with_entropy=with_entropy,
                                                          chunk_tokens=chunk_tokens, temperature=temperature),
                           hidden, weight_VD, g_logp, g_ent, with_entropy)
    want = values_and_grads(lambda: naive(hidden, weight_VD, target, temperature),
                            hidden, weight_VD, g_logp, g_ent, with_entropy)
    assert got[0].shape == shape and got[0].dtype == dtype
    for a, b in zip(got, want, strict=True):
        assert_rel(a, b, tol)


def test_flat_input_and_entropy_none():
    hidden, weight_VD, target, _, _ = make((9,), 8, 20, torch.float32)
    logp, ent = chunked_token_logprobs(hidden, weight_VD, target)
    assert ent is None and logp.shape == (9,) and logp.dtype == torch.float32
    assert_rel(logp, naive(hidden, weight_VD, target)[0], 1e-6)


def test_entropy_only_and_frozen_weight():
    hidden, weight_VD, target, _, g_ent = make((10,), 8, 30, torch.float64)
    weight_VD.requires_grad_(False)
    _, ent = chunked_token_logprobs(hidden, weight_VD, target, with_entropy=True, chunk_tokens=3)
    (ent * g_ent).sum().backward()
    got = hidden.grad
    hidden.grad = None
    (naive(hidden, weight_VD, target)[1] * g_ent).sum().backward()
    assert_rel(got, hidden.grad, 1e-12)
    assert weight_VD.grad is None


def test_bfloat16_close_to_reference():
    hidden, weight_VD, target, g_logp, g_ent = make((64,), 32, 100, torch.bfloat16)
    h64, w64 = (t.detach().double().requires_grad_(True) for t in (hidden, weight_VD))
    got = values_and_grads(lambda: chunked_token_logprobs(hidden, weight_VD, target, with_entropy=True,
                                                          chunk_tokens=10), hidden, weight_VD, g_logp, g_ent, True)
    want = values_and_grads(lambda: naive(h64, w64, target), h64, w64, g_logp.double(), g_ent.double(), True)
    assert got[0].dtype == torch.float32 and got[2].dtype == got[3].dtype == torch.bfloat16
    for a, b in zip(got, want, strict=True):
        assert_rel(a, b, 2e-2)


def test_gradcheck_float64():
    hidden, weight_VD, target, _, _ = make((5,), 4, 7, torch.float64)

    def fn(h, w):
        return chunked_token_logprobs(h, w, target, with_entropy=True, chunk_tokens=2, temperature=0.7)

    assert torch.autograd.gradcheck(fn, (hidden, weight_VD))


def test_saves_nothing_of_tokens_times_vocab():
    N, D, V = 64, 64, 151_936
    hidden, weight_VD, target, g_logp, g_ent = make((N,), D, V, torch.float32)
    inputs = {t.data_ptr() for t in (hidden, weight_VD)}

    def saved_sizes(fn) -> list[int]:
        """numel of every tensor saved for backward that is not one of the inputs hidden / weight."""
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.data_ptr() not in inputs:
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, ent = fn()
        (logp * g_logp + ent * g_ent).sum().backward()
        return sizes

    chunked = saved_sizes(lambda: chunked_token_logprobs(hidden, weight_VD, target, with_entropy=True,
                                                         chunk_tokens=8))
    assert chunked and max(chunked) <= N  # target, lse, entropy: O(N)
    assert max(saved_sizes(lambda: naive(hidden, weight_VD, target))) >= N * V  # the hook does see N x V tensors


def test_bad_target_raises():
    hidden, weight_VD, target, _, _ = make((6,), 4, 10, torch.float32)
    for bad in (10, -1):
        target[2] = bad
        with pytest.raises(ValueError, match=r"\[0, 10\)"):
            chunked_token_logprobs(hidden, weight_VD, target)


def test_default_chunk():
    assert default_chunk_tokens(151_936) == 2**26 // 151_936 == 441
    assert default_chunk_tokens(2**30) == 1


def test_input_checks():
    hidden, weight_VD, target, _, _ = make((6,), 4, 10, torch.float32)
    with pytest.raises(ValueError, match="one floating dtype"):
        chunked_token_logprobs(hidden, weight_VD.double(), target)
    with pytest.raises(ValueError, match="target shape"):
        chunked_token_logprobs(hidden, weight_VD, target[:5])
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logprobs(hidden, weight_VD, target, temperature=0.0)


def test_bitwise_repeatable():
    hidden, weight_VD, target, g_logp, g_ent = make((40,), 16, 300, torch.float32)
    runs = [values_and_grads(lambda: chunked_token_logprobs(hidden, weight_VD, target, with_entropy=True,
                                                            chunk_tokens=6), hidden, weight_VD, g_logp, g_ent, True)
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
