"""The decode step's fused small kernels against their torch references: RMSNorm and residual add + RMSNorm
(moerl/kernels/triton_norm.py vs moerl.kernels.norm's references) and the sort-free router top-k
(moerl/kernels/triton_router.py vs moerl.kernels.router.router_topk_reference).

Shape legend: R rows, D normalised dim, T tokens, E experts, K experts per token.

The kernels round as the torch expressions do, step by step, so the norms are compared bit for bit: the residual
sum must be equal, the normed rows equal but for the order of the sum of squares (a few-ulp float32 difference in
the scale, which a bf16 output shows in about 1e-4 of its elements; a float32 output in many, by a few ulps). The
router must choose the same experts in the same order on rows without near-ties (score gaps > 1e-6), with weights
within a bf16 ulp. Each case reports its bitwise-equal fraction. On CUDA the Triton wrappers are counted (a check
that silently took the torch path fails); the CPU smoke run (MOERL_GPU_SUITE_ON_CPU=1) runs the same code on the
references. Timings (torch ops vs one kernel per call in a replayed CUDA graph, the decode engine's setting, and
torch.compile's fusion of the same expression beside them): `moerl bench kernels --group decode`.
"""

from __future__ import annotations

import collections

import pytest
import torch
from gpu_helpers import randomize_

import moerl.kernels as kernels
from moerl.kernels.norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from moerl.kernels.router import router_topk, router_topk_reference
from moerl.model import build_model, tiny_config

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 7, 256, 4096]
# (leading shape after the rows, D): the hidden sizes of the 0.92B preset and of 30B-A3B; q_norm over head_dim
NORM_DIMS = {"D1024": ((), 1024), "D2048": ((), 2048), "heads32xd128": ((32,), 128)}
EPS = 1e-6
WRAPPERS = {"triton_norm": ("rms_norm_triton", "add_rms_norm_triton"), "triton_router": ("router_topk_triton",)}


@pytest.fixture
def triton_calls(device, monkeypatch) -> collections.Counter:
    """Calls into the Triton wrappers (CUDA only: those modules import triton). The dispatch imports them at call
    time, so wrapping the module attributes sees every call."""
    calls: collections.Counter = collections.Counter()
    if device.type == "cuda":
        import importlib

        for module_name, names in WRAPPERS.items():
            module = importlib.import_module(f"moerl.kernels.{module_name}")
            for name in names:
                def counted(*args, _fn=getattr(module, name), _name=name, **kw):
                    calls[_name] += 1
                    return _fn(*args, **kw)

                monkeypatch.setattr(module, name, counted)
    return calls


def assert_triton_ran(calls: collections.Counter, device: torch.device, names: list[str]) -> None:
    if device.type != "cuda":
        assert not calls  # the CPU smoke: the references, nothing counted
        return
    missing = [n for n in names if not calls[n]]
    assert not missing, f"the torch path ran instead of Triton's {missing} (kernels._TRITON={kernels._TRITON})"


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place, from the ordered bit patterns (float32, bf16 or fp16; int64)."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    int_t = {4: torch.int32, 2: torch.int16}[got.element_size()]
    magnitude = (1 << (8 * got.element_size() - 1)) - 1

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(int_t).long()
        return torch.where(bits < 0, -(bits & magnitude), bits)  # sign bit set: -magnitude (so -0 == +0)

    return (ordered(got) - ordered(want)).abs()


def equal_fraction(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((ulps(got, want) == 0).double().mean()) if got.numel() else 1.0


def norm_inputs(device, dtype, rows: int, dim: str, seed: int):
    lead, D = NORM_DIMS[dim]
    shape = (rows, *lead, D)
    gen = torch.Generator().manual_seed(seed)
    h = (2 * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)
    delta = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(device=device, dtype=dtype)
    return h, delta, w


def check_normed(got: torch.Tensor, want: torch.Tensor, what: str, act_dtype: torch.dtype | None = None) -> float:
    """The bitwise-equal fraction, after the bounds. float32 activations: within 64 ulps (the scale's sum order).
    bf16 activations: the normalised value's rounding to bf16 flips in ~1e-4 of the elements, by one bf16 ulp,
    which the weight product carries: at least 99.9% equal, a bf16 output within 2 ulps, a promoted float32
    output (float32 weight) within one bf16 ulp relative."""
    act_dtype = act_dtype or got.dtype
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    if not got.numel():
        return 1.0
    frac, worst = equal_fraction(got, want), int(ulps(got, want).max())
    if act_dtype == torch.float32:
        assert worst <= 64, f"{what}: {worst} ulps from the reference ({frac:.4%} bitwise equal)"
        return frac
    assert frac >= 0.999, f"{what}: only {frac:.4%} bitwise equal (worst {worst} ulps)"
    if got.dtype == act_dtype:
        assert worst <= 2, f"{what}: {worst} ulps from the reference ({frac:.4%} bitwise equal)"
    else:
        rel = float(((got - want).abs() / want.abs().clamp_min(1e-30)).max())
        assert rel <= 2 ** -7, f"{what}: {rel:.1e} relative from the reference ({frac:.4%} bitwise equal)"
    return frac


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", list(NORM_DIMS))
@pytest.mark.parametrize("rows", ROWS)
def test_norms_match_reference_bitwise(device, dtype, dim, rows, triton_calls, report):
    """rms_norm and add_rms_norm (the no-grad dispatch) against the torch expressions on the same inputs."""
    if device.type != "cuda" and rows > 7:
        pytest.skip("the CPU smoke runs the small shapes only")
    h, delta, w = norm_inputs(device, dtype, rows, dim, seed=rows + len(dim))
    with torch.no_grad():
        got = rms_norm(h, w, EPS)
        got_sum, got_add = add_rms_norm(h, delta, w, EPS)
    want = rms_norm_reference(h, w, EPS)
    want_sum, want_add = add_rms_norm_reference(h, delta, w, EPS)
    assert torch.equal(got_sum, want_sum), "the residual sum must round exactly as torch's add"
    what = f"{dtype} rows={rows} {dim}"
    fracs = (check_normed(got, want, f"rms_norm {what}"), check_normed(got_add, want_add, f"add_rms_norm {what}"))
    assert_triton_ran(triton_calls, device, ["rms_norm_triton", "add_rms_norm_triton"])
    if rows == 256:
        report(f"small kernels: {what}: bitwise equal to torch rms_norm {fracs[0]:.5f}, add_rms_norm {fracs[1]:.5f}")


def test_norm_strided_rows_and_mixed_dtypes(device, dtype, triton_calls):
    """The last position of each row (a strided view, as the model's last_logits_only norm) and a float32 weight
    on bf16 activations (the output promotes, as torch's product does)."""
    gen = torch.Generator().manual_seed(5)
    h_BTD = torch.randn(6, 5, 2048, generator=gen).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(2048, generator=gen)).to(device)
    for weight in (w.to(dtype), w):
        with torch.no_grad():
            got = rms_norm(h_BTD[:, -1:], weight, EPS)
        want = rms_norm_reference(h_BTD[:, -1:], weight, EPS)
        check_normed(got, want, f"strided {dtype} x {weight.dtype} weight", act_dtype=dtype)
    assert_triton_ran(triton_calls, device, ["rms_norm_triton"])


def router_logits(device, dtype, T: int, E: int, seed: int) -> torch.Tensor:
    """Each row a shuffled grid of E values in [-4, 4) (steps of 8/E, exact in bf16) plus a little noise: no two
    experts of a row tie, in any dtype."""
    gen = torch.Generator().manual_seed(seed)
    grid_TE = torch.stack([torch.randperm(E, generator=gen) for _ in range(T)]).float() - E / 2
    return (grid_TE * (8 / E) + 0.01 * torch.randn(T, E, generator=gen)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("E", [64, 128])
@pytest.mark.parametrize("T", ROWS)
def test_router_topk_matches_reference(device, dtype, E, T, triton_calls, report):
    """The same experts (as a set and in order) on rows whose top K+1 scores are > 1e-6 apart, weights within a
    bf16 ulp (float32: 16 ulps), with and without renormalisation and the expert bias."""
    if device.type != "cuda" and T > 7:
        pytest.skip("the CPU smoke runs the small shapes only")
    K = 8
    logits_TE = router_logits(device, dtype, T, E, seed=T + E)
    bias_E = 0.003 * torch.randn(E, generator=torch.Generator().manual_seed(E)).to(device)
    lines = []
    for norm_topk_prob in (True, False):
        for bias in (None, bias_E):
            with torch.no_grad():
                idx_TK, w_TK = router_topk(logits_TE, K, norm_topk_prob, bias)
            want_idx_TK, want_w_TK = router_topk_reference(logits_TE, K, norm_topk_prob, bias)
            case = f"{dtype} T={T} E={E} norm={norm_topk_prob} bias={bias is not None}"
            assert idx_TK.dtype == torch.int64 and w_TK.dtype == dtype and idx_TK.shape == (T, K)
            assert ((idx_TK >= 0) & (idx_TK < E)).all(), f"{case}: an index out of range"
            assert (idx_TK.sort(1).values.diff(dim=1) > 0).all(), f"{case}: an expert chosen twice"
            scores_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32) + (0 if bias is None else bias)
            top_TK1 = scores_TE.topk(K + 1, dim=-1).values
            clear_T = (top_TK1[:, :-1] - top_TK1[:, 1:]).min(-1).values > 1e-6
            assert clear_T.float().mean() >= 0.9, f"{case}: too many near-ties in the test's own inputs"
            set_eq = (idx_TK.sort(1).values == want_idx_TK.sort(1).values).all(1)[clear_T]
            order_eq = (idx_TK == want_idx_TK).all(1)[clear_T]
            assert set_eq.all() and order_eq.all(), (
                f"{case}: {int((~set_eq).sum())} rows chose other experts, {int((~order_eq).sum())} another order "
                f"(of {int(clear_T.sum())} rows without near-ties)")
            same_T = (idx_TK == want_idx_TK).all(1)
            worst = int(ulps(w_TK[same_T], want_w_TK[same_T]).max()) if same_T.any() else 0
            assert worst <= (16 if dtype == torch.float32 else 1), f"{case}: weights {worst} ulps from the reference"
            lines.append(f"norm={int(norm_topk_prob)},bias={int(bias is not None)}: "
                         f"{equal_fraction(w_TK[same_T], want_w_TK[same_T]):.4f}")
    assert_triton_ran(triton_calls, device, ["router_topk_triton"])
    if T == 256:
        report(f"small kernels: router {dtype} T={T} E={E} K={K}: indices equal in order; weights bitwise equal "
               + ", ".join(lines))


@pytest.mark.cuda_only
def test_router_ties_take_the_lowest_index(device):
    """Exactly equal scores: the kernel takes the lowest expert index first (torch.topk leaves that order open)."""
    from moerl.kernels.triton_router import router_topk_triton

    logits_TE = torch.zeros(3, 64, device=device, dtype=torch.bfloat16)
    logits_TE[1, [5, 9, 40]] = 1.0  # three equal winners, then 61 equal others
    idx_TK, w_TK = router_topk_triton(logits_TE, 8, True)
    assert idx_TK[0].tolist() == list(range(8)) and idx_TK[2].tolist() == list(range(8))
    assert idx_TK[1].tolist() == [5, 9, 40, 0, 1, 2, 3, 4]
    assert torch.equal(w_TK[0], torch.full((8,), 0.125, device=device, dtype=torch.bfloat16))


@pytest.mark.cuda_only
def test_kernels_capture_in_a_cuda_graph(device):
    """Captured once, replayed on new inputs written in place: the replay equals an eager call (no host syncs, no
    shapes or pointers read back at capture)."""
    h, delta, w = norm_inputs(device, torch.bfloat16, 256, "D2048", seed=1)
    logits_TE = router_logits(device, torch.bfloat16, 256, 128, seed=2)
    bias_E = torch.zeros(128, device=device)

    def step():
        s, x = add_rms_norm(h, delta, w, EPS)
        return s, x, rms_norm(x, w, EPS), *router_topk(logits_TE, 8, True, bias_E)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        h2, delta2, _ = norm_inputs(device, torch.bfloat16, 256, "D2048", seed=3)
        h.copy_(h2)
        delta.copy_(delta2)
        logits_TE.copy_(router_logits(device, torch.bfloat16, 256, 128, seed=4))
        graph.replay()
        want = step()
    for got, ref in zip(outs, want, strict=True):
        assert torch.equal(got, ref)


def test_model_no_grad_forward_takes_the_kernels(device, dtype, triton_calls, report, monkeypatch):
    """The model's no-grad forward (the engine's) runs the fused norms. Against the autograd forward (the
    references) replaying its routing, the logits agree; unreplayed, the routing agrees but where a 1-ulp
    difference meets a near-tie of the router's logits."""
    cfg = tiny_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64)
    model = build_model(cfg, seed=0)
    randomize_(model, seed=11)
    model = model.to(device=device, dtype=dtype)
    ids_BT = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(12)).to(device)
    with torch.no_grad():
        fused = model.forward_full(ids_BT)
    assert_triton_ran(triton_calls, device, ["rms_norm_triton", "add_rms_norm_triton"])
    # grad on, the training norm kernels off: torch's norms are the references
    monkeypatch.setattr("moerl.kernels.norm.fused_norm_train_applies", lambda *a: False)
    ref = model.forward_full(ids_BT, routed_experts_BTLK=fused.routed_experts_BTLK)
    got_BTV, want_BTV = fused.logits_BTV.float(), ref.logits_BTV.detach().float()
    err = float((got_BTV - want_BTV).norm() / want_BTV.norm())
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2), f"logits rel. error {err:.1e}"
    own = model.forward_full(ids_BT).routed_experts_BTLK
    same = float((own.sort(-1).values == fused.routed_experts_BTLK.sort(-1).values).all(-1).double().mean())
    assert same >= 0.95, f"only {same:.1%} of the (position, layer) pairs chose the same experts"
    report(f"small kernels: tiny model {dtype}: no-grad (fused) vs autograd (torch) forward: logits rel. error "
           f"{err:.1e} (same routing), routing set-equal {same:.4f}")
