"""The training (grad-enabled) RMSNorm and residual add + RMSNorm: Triton forward + backward behind autograd
Functions (moerl/kernels/triton_norm_train.py), against a float64 reference, against the torch expression they
replace (moerl.kernels.norm's references) and under activation checkpointing (full and selective).

Shape legend: R rows, D normalised dim.

On CUDA the model's dispatch (moerl.kernels.norm.rms_norm / add_rms_norm, grad enabled) is what runs, and the calls
into the Triton wrappers are counted (a check that silently took the torch path fails). On the CPU smoke
(MOERL_GPU_SUITE_ON_CPU=1) the dispatch would take the torch references, so under TRITON_INTERPRET=1 the test lets
it take the kernels on CPU tensors (the interpreter runs them); without the interpreter these tests skip. The
interpreter casts float32 to bf16 by truncation, not round-to-nearest-even as a GPU does, so its bf16 bounds are
looser and nothing is asked bitwise of it in bf16; fp16 (rounded exactly there) checks the rounding steps.
Timings (forward + backward at the trainer's shape, against the torch expressions and torch.compile):
`moerl bench kernels --group train`.
"""

from __future__ import annotations

import collections
import importlib.util
import os

import pytest
import torch
from gpu_helpers import randomize_, rel_err
from torch import nn
from torch.utils.checkpoint import checkpoint

from moerl.kernels import norm as norm_mod
from moerl.kernels.norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from moerl.model import build_model, tiny_config
from moerl.model.checkpointing import context_fn
from moerl.model.layers import RMSNorm

EPS = 1e-6
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROWS = [1, 7, 4096]
DIMS = [64, 96, 1024, 2048]  # head_dim, a non-power of two, the 1.65B preset's hidden, 30B-A3B's
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_interpreted(device: torch.device) -> bool:
    return device.type != "cuda"


def tol(dtype: torch.dtype, device: torch.device) -> float:
    """Relative (norm-wise) bound against float64: a few roundings of the dtype's epsilon; the interpreter's
    truncating bf16 casts err twice as far, one-sided."""
    if dtype == torch.float32:
        return 1e-5
    if dtype == torch.float16:
        return 2e-3
    return 1.5e-2 if cpu_interpreted(device) else 8e-3


@pytest.fixture
def train_calls(device, monkeypatch) -> collections.Counter:
    """Calls into the training wrappers. CPU: only under the interpreter, where the dispatch is let onto CPU tensors
    (moerl.kernels.norm's use_triton patched; the model and every other kernel untouched)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if device.type != "cuda":
        if not INTERPRETED:
            pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
        monkeypatch.setattr(norm_mod, "use_triton", lambda x: x.dtype in norm_mod._FLOATS)
    import moerl.kernels.triton_norm_train as mod

    calls: collections.Counter = collections.Counter()
    for name in ("rms_norm_train", "add_rms_norm_train"):
        def counted(*args, _fn=getattr(mod, name), _name=name, **kw):
            calls[_name] += 1
            return _fn(*args, **kw)

        monkeypatch.setattr(mod, name, counted)
    return calls


def inputs(device, dtype, R: int, D: int, seed: int):
    """(h, delta, w, dy, dsum): leaves that need grads for the first three, upstream gradients for the last two."""
    gen = torch.Generator().manual_seed(seed)
    draw = [2 * torch.randn(R, D, generator=gen), torch.randn(R, D, generator=gen),
            1 + 0.1 * torch.randn(D, generator=gen), torch.randn(R, D, generator=gen), torch.randn(R, D, generator=gen)]
    h, delta, w, dy, dsum = (t.to(device=device, dtype=dtype) for t in draw)
    return h.requires_grad_(), delta.requires_grad_(), w.requires_grad_(), dy, dsum


def run(fused_add: bool, h, delta, w, dy, dsum, norm_fn=rms_norm, add_fn=add_rms_norm):
    """(outputs, gradients): norm -> (y,), (dx, dw); add+norm -> (sum, y), (dh, ddelta, dw)."""
    if fused_add:
        outs = add_fn(h, delta, w, EPS)
        return outs, torch.autograd.grad(outs, (h, delta, w), (dsum, dy))
    y = norm_fn(h, w, EPS)
    return (y,), torch.autograd.grad(y, (h, w), dy)


def float64_reference(fused_add: bool, h, delta, w, dy, dsum):
    """The same function in float64 throughout: no rounding between the steps."""
    leaves = [t.detach().double().requires_grad_() for t in (h, delta, w)]
    h64, d64, w64 = leaves

    def norm64(x, weight, eps):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def add_norm64(a, b, weight, eps):
        s = a + b
        return s, norm64(s, weight, eps)

    return run(fused_add, h64, d64, w64, dy.double(), dsum.double(), norm64, add_norm64)


@pytest.mark.parametrize("fused_add", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("D", DIMS)
@pytest.mark.parametrize("R", ROWS)
def test_train_norm_matches_float64(device, dtype, R, D, fused_add, train_calls, report):
    """Forward and every gradient (dx, dw; add+norm: dh, ddelta, dw) within the dtype's bound of float64, and no
    further from it than the torch expression's own error allows (2x + a float32 floor)."""
    if cpu_interpreted(device) and R * D > 4096 * 64:
        pytest.skip("the interpreter runs the 4096-row cases at head_dim only")
    args = inputs(device, dtype, R, D, seed=R + D + fused_add)
    got_out, got_grads = run(fused_add, *args)
    assert train_calls["add_rms_norm_train" if fused_add else "rms_norm_train"] == 1, dict(train_calls)
    want_out, want_grads = float64_reference(fused_add, *args)
    torch_out, torch_grads = run(fused_add, *args, rms_norm_reference, add_rms_norm_reference)
    names = (["sum", "y"] if fused_add else ["y"]) + (["dh", "ddelta", "dw"] if fused_add else ["dx", "dw"])
    errs = {}
    for name, got, want, ref in zip(names, (*got_out, *got_grads), (*want_out, *want_grads),
                                    (*torch_out, *torch_grads), strict=True):
        assert got.dtype == dtype and got.shape == want.shape, (name, got.dtype, got.shape)
        err, torch_err = rel_err(got, want), rel_err(ref, want)
        errs[name] = err
        assert err <= tol(dtype, device), f"{name}: rel. error {err:.2e} vs float64 (torch's {torch_err:.2e})"
        assert err <= 2 * torch_err + (1e-6 if dtype == torch.float32 else tol(dtype, device) / 2), \
            f"{name}: rel. error {err:.2e} vs float64, torch's {torch_err:.2e}"
    if fused_add:
        assert torch.equal(got_grads[0], got_grads[1]), "h and delta get the gradient of their sum"
    if R == 4096 and D in (64, 1024):
        report(f"norm train {dtype} R={R} D={D} {'add+norm' if fused_add else 'norm'}: rel. error vs float64 "
               + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))


@pytest.mark.parametrize("fused_add", [False, True], ids=["norm", "add_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_train_norm_matches_the_torch_path(device, dtype, fused_add, train_calls):
    """Against the torch expression on the same inputs: it rounds where torch's graph rounds (the normalised rows
    and the gradient reaching the cast, in x's dtype), so the forward, the residual sum and dx are equal but for the
    order of the row sums; dw sums float32 products where torch rounds each to the dtype first. The forward is
    bitwise the no-grad (engine) kernel's."""
    interp_bf16 = cpu_interpreted(device) and dtype == torch.bfloat16  # truncating casts: a looser bound only
    for R, D in ((7, 96), (300, 64), (33, 1024)):
        args = inputs(device, dtype, R, D, seed=3 * R + D)
        got_out, got_grads = run(fused_add, *args)
        want_out, want_grads = run(fused_add, *args, rms_norm_reference, add_rms_norm_reference)
        if fused_add and not interp_bf16:
            assert torch.equal(got_out[0], want_out[0]), "the residual sum rounds as torch's add"
        with torch.no_grad():  # the no-grad dispatch: the engine's forward kernel, which training's forward reuses
            engine_out = add_rms_norm(*args[:3], EPS) if fused_add else (rms_norm(args[0], args[2], EPS),)
        assert all(torch.equal(a, b) for a, b in zip(got_out, engine_out, strict=True)), "forward != no-grad kernel's"
        close = 1e-2 if interp_bf16 else {torch.float32: 1e-6, torch.bfloat16: 2e-3, torch.float16: 3e-4}[dtype]
        for name, got, want in (("y", got_out[-1], want_out[-1]), ("dx", got_grads[0], want_grads[0])):
            assert rel_err(got, want) <= close, f"{name} R={R} D={D}: rel. error {rel_err(got, want):.2e} vs torch"
        dw_close = 1e-2 if interp_bf16 else {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        assert rel_err(got_grads[-1], want_grads[-1]) <= dw_close, \
            f"dw R={R} D={D}: rel. error {rel_err(got_grads[-1], want_grads[-1]):.2e} vs torch"
    assert train_calls["add_rms_norm_train" if fused_add else "rms_norm_train"] == 3, dict(train_calls)


def test_train_norm_mixed_weight_dtype_and_strided_grad(device, train_calls):
    """A float32 weight on bf16 rows (the output promotes to float32, dw comes back float32) and an upstream
    gradient that is a transposed view (q_norm's output is transposed to [B, H, T, d] after the norm)."""
    gen = torch.Generator().manual_seed(9)
    x = (2 * torch.randn(3, 5, 4, 64, generator=gen)).to(device=device, dtype=torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(64, generator=gen)).to(device).requires_grad_()
    dy = torch.randn(3, 4, 5, 64, generator=gen).to(device).transpose(1, 2)  # not contiguous
    results = []
    for fn in (rms_norm, rms_norm_reference):
        y = fn(x, w, EPS)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        assert (y.dtype, dx.dtype, dw.dtype) == (torch.float32, torch.bfloat16, torch.float32), fn.__name__
        results.append((y, dx, dw))
    bound = 1e-2 if cpu_interpreted(device) else 4e-3
    for name, got, want in zip(("y", "dx", "dw"), *results, strict=True):
        assert rel_err(got, want) <= bound, f"{name}: rel. error {rel_err(got, want):.2e} vs torch"
    assert train_calls["rms_norm_train"] == 1


class NormBlock(nn.Module):
    """The decoder layer's norms in its order: input norm, a projection, per-head q norm, add + post norm."""

    def __init__(self, D: int, d: int) -> None:
        super().__init__()
        self.d = d
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(D, EPS), RMSNorm(D, EPS)
        self.q_norm = RMSNorm(d, EPS)
        self.proj = nn.Linear(D, D, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(self.proj(self.input_layernorm(h)).view(*h.shape[:-1], -1, self.d))
        h, x = self.post_attention_layernorm.add_and_norm(h, q.flatten(-2))
        return h + x * x


def block_grads(block: NormBlock, h: torch.Tensor, probe: torch.Tensor, mode) -> list[torch.Tensor]:
    h = h.detach().requires_grad_()
    out = checkpoint(block, h, use_reentrant=False, context_fn=context_fn(mode)) if mode else block(h)
    return list(torch.autograd.grad((out.float() * probe).sum(), (h, *block.parameters())))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_train_norm_under_activation_checkpointing(device, dtype, train_calls, monkeypatch):
    """Full and selective checkpointing recompute the kernels (each Function runs twice) and give the gradients of
    the plain backward bitwise (the kernels are deterministic; the checkpoint's own check, same saved tensors on
    recompute, passes). Those gradients are the torch path's within the dtype's bound, and (float32) a central
    difference along a random direction agrees with autograd's directional derivative (gradcheck's test)."""
    D, d = 128, 32
    block = NormBlock(D, d)
    randomize_(block, seed=3)
    block = block.to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    h = (2 * torch.randn(2, 9, D, generator=gen)).to(device=device, dtype=dtype)
    probe = torch.randn(2, 9, D, generator=gen).to(device)
    plain = block_grads(block, h, probe, False)
    calls_per_pass = dict(train_calls)
    assert calls_per_pass == {"rms_norm_train": 2, "add_rms_norm_train": 1}, calls_per_pass
    for mode in (True, "selective"):
        train_calls.clear()
        got = block_grads(block, h, probe, mode)
        assert dict(train_calls) == {k: 2 * v for k, v in calls_per_pass.items()}, (mode, dict(train_calls))
        assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True)), f"checkpointing {mode!r}"
    with monkeypatch.context() as m:
        m.setattr(norm_mod, "fused_norm_train_applies", lambda x, w: False)
        torch_path = block_grads(block, h, probe, True)
    for a, b in zip(plain, torch_path, strict=True):
        assert rel_err(a, b) <= (1e-5 if dtype == torch.float32 else 2e-2), f"rel. error {rel_err(a, b):.2e}"
    if dtype != torch.float32:
        return
    v = torch.randn(h.shape, generator=gen).to(device)
    step = 1e-2

    def loss(x: torch.Tensor) -> float:
        with torch.enable_grad():  # the training path (nothing here needs a gradient)
            return float((block(x).double() * probe).sum().detach())

    numeric = (loss(h + step * v) - loss(h - step * v)) / (2 * step)
    analytic = float((plain[0].double() * v).sum())
    print(f"directional derivative: central difference {numeric:.6f}, autograd {analytic:.6f}")
    assert abs(numeric - analytic) <= 1e-3 * max(1.0, abs(analytic)), (numeric, analytic)


@pytest.mark.parametrize("mode", [False, True, "selective"])
def test_model_training_forward_takes_the_kernels(device, dtype, mode, train_calls):
    """A tiny model's training forward + backward runs every norm through the Functions (two RMSNorms and the
    add + norm per layer: input, q_norm, k_norm, add + post-attention; the final norm), with or without
    checkpointing; the gradients are the torch path's within the dtype's bound."""
    cfg = tiny_config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=2)
    model = build_model(cfg, seed=0)
    randomize_(model, seed=5)
    model = model.to(device=device, dtype=dtype)
    ids_BT = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6)).to(device)
    with torch.no_grad():
        routes = model.forward_full(ids_BT).routed_experts_BTLK  # replayed below: one routing for both paths
    train_calls.clear()

    def grads() -> list[torch.Tensor]:
        model.enable_activation_checkpointing(mode)
        try:
            logits = model.forward_full(ids_BT, routed_experts_BTLK=routes).logits_BTV
            return list(torch.autograd.grad(logits.float().logsumexp(-1).sum(), list(model.parameters())))
        finally:
            model.enable_activation_checkpointing(False)

    got = grads()
    L, recompute = cfg.num_hidden_layers, 2 if mode else 1
    assert dict(train_calls) == {"rms_norm_train": 3 * L * recompute + 1, "add_rms_norm_train": L * recompute}, \
        dict(train_calls)
    orig = norm_mod.fused_norm_train_applies
    norm_mod.fused_norm_train_applies = lambda x, w: False
    try:
        want = grads()
    finally:
        norm_mod.fused_norm_train_applies = orig
    worst = max(rel_err(a, b) for a, b in zip(got, want, strict=True))
    assert worst <= (1e-4 if dtype == torch.float32 else 5e-2), f"worst parameter gradient rel. error {worst:.1e}"
