"""The fused MoE decode path (moerl/kernels/fused_moe.py, triton_fused_moe.py) on the device.

Shape legend: T tokens, K slots per token, E experts, D hidden, I expert intermediate.

One MoE block at the Qwen3-30B-A3B expert shape and at the 0.92B preset's, against the float64 block on the same
weights (experts_impl="loop") with the float64 router's routing replayed (a near-tie must not pick other experts
in bf16), by ||got - want|| / ||want||. T covers every bucket of the block-config table, so every shipped config
compiles and runs. The CPU smoke run (tiny shape) checks the torch reference of the path the same way.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from gpu_helpers import rel_err

from moerl.kernels.fused_moe import fused_moe_reference, moe_align_reference
from moerl.model.config import MoEModelConfig
from moerl.model.moe import FUSED_MAX_TOKENS, SparseMoEBlock

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}  # test_kernels_gpu.py's bounds
# Against the torch reference in the same dtype only the float32 summation order differs; a bf16 rounding that
# flips on it moves one element by an ulp.
SAME_DTYPE_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
SHAPES = {"30b": (128, 2048, 768), "0.9b": (64, 1024, 256)}  # E, D, I; top-8 both
TOKENS = [1, 3, 64, 256, 1000]
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def no_tf32(device, monkeypatch):
    if device.type == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.fixture(scope="module")
def blocks(device):
    """blocks(shape, dtype) -> (float64 loop block, block in dtype with experts_impl 'fused'); built once each."""
    cache: dict = {}

    def get(shape: str, dtype: torch.dtype) -> tuple[SparseMoEBlock, SparseMoEBlock]:
        if (shape, torch.float64) not in cache:
            E, D, I = SHAPES[shape] if device.type == "cuda" else (6, 32, 16)
            cfg = MoEModelConfig(hidden_size=D, num_experts=E, num_experts_per_tok=8 if device.type == "cuda" else 2,
                                 moe_intermediate_size=I, norm_topk_prob=True, num_attention_heads=4,
                                 num_key_value_heads=4, head_dim=D // 4)
            block64 = SparseMoEBlock(cfg, experts_impl="loop").to(device=device, dtype=torch.float64)
            gen = torch.Generator(device=device).manual_seed(28)
            with torch.no_grad():
                for p in block64.parameters():  # drawn on the device: 30B's experts are 0.6G numbers
                    p.normal_(0.0, 0.02, generator=gen)
            cache[shape, torch.float64] = block64
        if (shape, dtype) not in cache:
            block = copy.deepcopy(cache[shape, torch.float64]).to(dtype)
            block.experts.impl = "fused"
            cache[shape, dtype] = block
        return cache[shape, torch.float64], cache[shape, dtype]

    yield get
    cache.clear()


@pytest.fixture
def fused_calls(device, monkeypatch) -> collections.Counter:
    """Calls into the Triton path (CUDA only: that module imports triton); fused_moe imports it at call time."""
    calls: collections.Counter = collections.Counter()
    if device.type == "cuda":
        from moerl.kernels import triton_fused_moe

        def counted(*args, _fn=triton_fused_moe.fused_moe_triton, **kw):
            calls["fused_moe_triton"] += 1
            return _fn(*args, **kw)

        monkeypatch.setattr(triton_fused_moe, "fused_moe_triton", counted)
    return calls


def draw_x(T: int, D: int, seed: int) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def fused_forward(block: SparseMoEBlock, x_TD: torch.Tensor, replay_TK: torch.Tensor) -> torch.Tensor:
    """The block's fused path on CUDA; on the CPU smoke run (no Triton) the path's torch reference."""
    if x_TD.is_cuda:
        return block(x_TD, replay_TK).out_TD
    routed = block.gate(x_TD, replay_TK)
    return fused_moe_reference(x_TD, replay_TK, routed.topk_weights_TK, block.experts.gate_up_proj,
                               block.experts.down_proj)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
@torch.no_grad()
def test_fused_matches_float64(device, blocks, shape, T, dtype, fused_calls, report):
    block64, block = blocks(shape, dtype)
    T = T if device.type == "cuda" else min(T, 17)
    x64 = draw_x(T, block64.gate.weight.shape[1], seed=T).to(device)
    replay_TK = block64.gate(x64).topk_idx_TK
    want = block64(x64, replay_TK).out_TD
    x_TD = x64.to(dtype)
    got = fused_forward(block, x_TD, replay_TK)
    err = rel_err(got, want)
    routed = block.gate(x_TD, replay_TK)
    ref = fused_moe_reference(x_TD, replay_TK, routed.topk_weights_TK, block.experts.gate_up_proj,
                              block.experts.down_proj)
    err_ref = rel_err(got, ref)
    report(f"fused MoE {shape} T={T} {str(dtype)[6:]}: rel. err vs float64 {err:.2e}, vs the torch reference in "
           f"{str(dtype)[6:]} {err_ref:.2e}")
    assert got.dtype == dtype and got.shape == want.shape
    assert err <= TOL[dtype], f"rel. err {err:.2e} against float64"  # NaN fails
    assert err_ref <= SAME_DTYPE_TOL[dtype], f"rel. err {err_ref:.2e} against the same-dtype reference"
    if device.type == "cuda":
        assert fused_calls["fused_moe_triton"] == 1, "the Triton path did not run"


@pytest.mark.cuda_only
@pytest.mark.parametrize("shape", list(SHAPES))
@torch.no_grad()
def test_fused_agrees_with_grouped_mm(device, blocks, shape, report):
    """Both paths round gate/up, h and y to bf16 and combine in float32: only summation order differs."""
    _, block = blocks(shape, torch.bfloat16)
    for T in (64, 256):
        x_TD = draw_x(T, block.gate.weight.shape[1], seed=100 + T).to(device, torch.bfloat16)
        replay_TK = block.gate(x_TD).topk_idx_TK
        block.experts.impl = "grouped_mm"
        grouped = block(x_TD, replay_TK).out_TD
        block.experts.impl = "fused"
        err = rel_err(block(x_TD, replay_TK).out_TD, grouped)
        report(f"fused vs grouped_mm {shape} T={T} bf16: rel. diff {err:.2e}")
        assert err <= 3e-3, f"fused and grouped_mm differ by {err:.2e} at T={T}"


@pytest.mark.cuda_only
@pytest.mark.parametrize("shape", list(SHAPES))
def test_self_check_passes(device, blocks, shape, report):
    """Auto takes the fused path only after this check; a failure here means decode silently ran grouped GEMMs."""
    from moerl.kernels.fused_moe import fused_moe_self_check

    _, block = blocks(shape, torch.bfloat16)
    reason = fused_moe_self_check(block.experts.gate_up_proj, block.experts.down_proj, block.gate.top_k)
    report(f"fused MoE self-check [{shape}] bf16: {'passed' if reason is None else reason}")
    assert reason is None, reason


@pytest.mark.cuda_only
def test_auto_picks_fused_at_decode_without_grad(device, blocks, monkeypatch):
    import moerl.model.moe as moe

    _, block = blocks("0.9b", torch.bfloat16)
    calls = collections.Counter()
    monkeypatch.setattr(moe, "fused_moe", lambda *a, _fn=moe.fused_moe, **kw: calls.update(["fused"]) or _fn(*a, **kw))
    block.experts.impl = "auto"
    try:
        D = block.gate.weight.shape[1]
        with torch.no_grad():
            block(torch.randn(64, D, device=device, dtype=torch.bfloat16))
            assert calls["fused"] == 1, "auto did not take the fused path at 64 tokens under no_grad"
            block(torch.randn(FUSED_MAX_TOKENS + 1, D, device=device, dtype=torch.bfloat16))
            assert calls["fused"] == 1, "auto took the fused path past FUSED_MAX_TOKENS"
        with torch.inference_mode():
            block(torch.randn(8, D, device=device, dtype=torch.bfloat16))
            assert calls["fused"] == 2
        x_TD = torch.randn(64, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        out = block(x_TD).out_TD
        assert calls["fused"] == 2 and out.grad_fn is not None, "with grad auto must keep the grouped GEMM"
        out.float().sum().backward()
        block.experts.impl = "fused"
        with pytest.raises(ValueError, match="no backward"):
            block(x_TD)
        capped = SparseMoEBlock(_config_of(block), capacity_factor=1.0, experts_impl="fused").to(device,
                                                                                               torch.bfloat16)
        with torch.no_grad(), pytest.raises(ValueError, match="capacity"):
            capped(torch.randn(4, D, device=device, dtype=torch.bfloat16))
    finally:
        block.experts.impl = "fused"
        block.zero_grad(set_to_none=True)


def _config_of(block: SparseMoEBlock) -> MoEModelConfig:
    E, D = block.gate.weight.shape
    return MoEModelConfig(hidden_size=D, num_experts=E, num_experts_per_tok=block.gate.top_k,
                          moe_intermediate_size=block.experts.intermediate_size, num_attention_heads=4,
                          num_key_value_heads=4, head_dim=D // 4)


def captured(fn, *static):
    """fn(*static) captured in a CUDA graph after a side-stream warm-up (Triton compiles outside the capture, as
    decode_graphs does): (graph, its static output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    return graph, out


@pytest.mark.cuda_only
@pytest.mark.parametrize("shape,T", [("30b", 64), ("0.9b", 1), ("0.9b", 256)])
@torch.no_grad()
def test_fused_path_replays_in_a_cuda_graph(device, blocks, shape, T, fused_calls, report):
    """Captured once, replayed on new inputs with other routing: the eager result. The fused path alone (Triton
    kernels only: no atomics, fixed grids that exit past the valid row blocks) bit for bit; the whole block (its
    router runs cuBLAS, whose kernel choice may differ under capture) within 1e-3 and with the same routing."""
    from moerl.kernels.fused_moe import fused_moe

    _, block = blocks(shape, torch.bfloat16)
    E, D = block.gate.weight.shape
    K = block.gate.top_k
    gen = torch.Generator(device=device).manual_seed(T)
    weights = (block.experts.gate_up_proj, block.experts.down_proj)

    def draw():
        x_TD = torch.randn(T, D, device=device, dtype=torch.bfloat16, generator=gen)
        idx_TK = torch.rand(T, E, device=device, generator=gen).topk(K, dim=-1).indices
        return x_TD, idx_TK, torch.rand(T, K, device=device, generator=gen).to(torch.bfloat16)

    static = draw()
    graph, out_TD = captured(lambda x, i, w: fused_moe(x, i, w, *weights), *static)
    for _ in range(3):
        new = draw()
        assert not torch.equal(new[1], static[1])
        for dst, src in zip(static, new, strict=True):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out_TD, fused_moe(*new, *weights)), "the replayed fused path differs from eager"

    block.experts.impl = "auto"
    try:
        x_static = draw()[0]
        graph, out = captured(block, x_static)
        # 6 calls of the fused path alone (2 warm-ups, the capture, 3 eager), 3 by the block's warm-ups and capture
        assert fused_calls["fused_moe_triton"] == 9, "auto did not take the fused path in the block"
        worst, bitwise = 0.0, True
        for _ in range(3):
            x_new = 3.0 * draw()[0]
            x_static.copy_(x_new)
            graph.replay()
            eager = block(x_new)
            assert torch.equal(out.topk_idx_TK, eager.topk_idx_TK), "the replayed routing differs from eager"
            worst = max(worst, rel_err(out.out_TD, eager.out_TD))
            bitwise = bitwise and torch.equal(out.out_TD, eager.out_TD)
    finally:
        block.experts.impl = "fused"
    report(f"fused MoE block {shape} T={T} in a CUDA graph: replay vs eager " +
           ("bitwise equal" if bitwise else f"rel. diff {worst:.1e}"))
    assert worst <= 1e-3


@pytest.mark.cuda_only
def test_triton_alignment_equals_reference(device):
    """The two-launch alignment kernel against the one-hot reference, bit for bit, on random and adversarial
    routings (one hot expert, T=1, more experts than pairs, E not a power of two, many chunks)."""
    from moerl.kernels.triton_fused_moe import moe_align

    gen = torch.Generator().manual_seed(7)
    distinct = lambda T, K, E: torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])  # noqa: E731
    cases = [(distinct(1, 8, 128), 128), (distinct(256, 8, 128), 128), (distinct(1000, 8, 64), 64),
             (distinct(37, 3, 13), 13), (distinct(2, 2, 130), 130), (torch.full((300, 8), 5), 128),
             (torch.randint(0, 3, (4096, 8), generator=gen), 200)]
    for idx_TK, E in cases:
        idx_TK = idx_TK.to(device)
        for block_m in (16, 32, 64, 128):
            got = moe_align(idx_TK, E, block_m)
            want = moe_align_reference(idx_TK, E, block_m)
            names = ("pair_S", "expert_B", "num_blocks")
            for name, g, w in zip(names, got, want, strict=True):
                assert torch.equal(g, w), f"{name} differs (T={idx_TK.shape[0]}, E={E}, BLOCK_M={block_m})"
