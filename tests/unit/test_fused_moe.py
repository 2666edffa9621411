"""The fused MoE decode path's torch side (moerl/kernels/fused_moe.py, fused_moe_configs.py): the sort-free
alignment, the numerics reference, the block-config table, and SparseMoEBlock's choice of path on a CPU. The
Triton kernels themselves are checked against these in tests/gpu/test_fused_moe_gpu.py."""

from __future__ import annotations

import pytest
import torch

from moerl.kernels.fused_moe import fused_moe_reference, moe_align_reference
from moerl.kernels.fused_moe_configs import (M_BUCKETS, SHARED_MEMORY_BYTES, _CONFIGS, KernelConfig, fused_moe_configs,
                                             m_bucket, max_row_blocks, shared_memory)
from moerl.model import MoEModelConfig
from moerl.model.moe import SparseMoEBlock


def expected_alignment(idx_TK: torch.Tensor, E: int, block_m: int) -> tuple[list[int], list[int], int]:
    """The alignment spelled out in Python: each expert's pairs in pair order, padded with M to whole blocks."""
    flat = idx_TK.reshape(-1).tolist()
    M = len(flat)
    rows, experts = [], []
    for e in range(E):
        pairs = [m for m, x in enumerate(flat) if x == e]
        blocks = -(-len(pairs) // block_m)
        rows += pairs + [M] * (blocks * block_m - len(pairs))
        experts += [e] * blocks
    B = max_row_blocks(M, E, block_m)
    return rows + [M] * (B * block_m - len(rows)), experts + [-1] * (B - len(experts)), len(experts)


def routings() -> list[tuple[str, torch.Tensor, int]]:
    gen = torch.Generator().manual_seed(0)
    distinct = lambda T, K, E: torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])  # noqa: E731
    return [
        ("T=1", distinct(1, 8, 128), 128),
        ("random", distinct(64, 8, 128), 128),
        ("E not a power of 2", distinct(37, 3, 13), 13),
        ("more experts than pairs", distinct(2, 2, 130), 130),
        ("all tokens to one expert", torch.full((70, 1), 4), 6),
        ("all tokens to the last expert", torch.full((33, 1), 8), 9),
        ("two hot experts", torch.tensor([[0, 5]] * 45), 6),
        ("skewed, unused experts", torch.stack([torch.tensor([1, 3 + t % 2]) for t in range(50)]), 7),
        ("large", distinct(1000, 8, 64), 64),
    ]


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("name,idx_TK,E", routings(), ids=[r[0] for r in routings()])
def test_align_reference(name, idx_TK, E, block_m):
    pair_S, expert_B, num_blocks = moe_align_reference(idx_TK, E, block_m)
    assert pair_S.dtype == expert_B.dtype == num_blocks.dtype == torch.int32 and num_blocks.shape == (1,)
    rows, experts, valid = expected_alignment(idx_TK, E, block_m)
    assert pair_S.tolist() == rows and expert_B.tolist() == experts and int(num_blocks) == valid
    # The properties the kernels rely on, stated directly.
    M = idx_TK.numel()
    real = pair_S[pair_S < M]
    assert sorted(real.tolist()) == list(range(M))  # every pair exactly once
    flat = idx_TK.reshape(-1)
    for b in range(valid):
        block = pair_S[b * block_m:(b + 1) * block_m]
        kept = block[block < M].long()
        assert kept.numel() > 0 and (flat[kept] == expert_B[b]).all()  # one expert per block, never empty
        assert torch.equal(kept, block[: kept.numel()].long())  # padding only after the pairs
    assert (pair_S[valid * block_m:] == M).all()
    assert torch.equal(real.long(), torch.sort(flat * M + torch.arange(M)).values % M)  # expert-major, stable


def test_align_sizes_are_fixed_by_shape():
    """Output sizes depend on (T, K, E, BLOCK_M) only, never on the routing: a captured graph replays any."""
    shapes = {tuple(t.shape for t in moe_align_reference(idx, 16, 16))
              for idx in (torch.zeros(40, 4, dtype=torch.long), torch.arange(160).view(40, 4) % 16)}
    assert len(shapes) == 1


def test_config_table_covers_buckets_and_fits_shared_memory():
    assert [m_bucket(T) for T in (1, 2, 16, 17, 64, 65, 256, 257, 4096)] == \
        ["1", "2-16", "2-16", "17-64", "17-64", "65-256", "65-256", "257+", "257+"]
    for shape, kernels in _CONFIGS.items():
        for kernel, by_bucket in kernels.items():
            assert set(by_bucket) == set(M_BUCKETS), (shape, kernel)
            for cfg in map(KernelConfig._make, by_bucket.values()):
                tiles = 2 if kernel == "gate_up" else 1  # gate and up tiles
                assert shared_memory(cfg, tiles, 2) <= SHARED_MEMORY_BYTES, (shape, kernel, cfg)  # bf16 as shipped
                assert min(cfg.block_m, cfg.block_n, cfg.block_k) >= 16  # tl.dot's smallest tile
    for T in (1, 16, 64, 256, 1024):  # float32 activations: the same tiles, fitted
        for (E, D, I) in _CONFIGS:
            gate_up, down = fused_moe_configs(E, D, I, T, element_size=4)
            assert shared_memory(gate_up, 2, 4) <= SHARED_MEMORY_BYTES
            assert shared_memory(down, 1, 4) <= SHARED_MEMORY_BYTES


def test_configs_clamp_to_small_shapes():
    gate_up, down = fused_moe_configs(E=6, D=32, I=24, T=300)
    assert (gate_up.block_n, gate_up.block_k) == (32, 32) and (down.block_n, down.block_k) == (32, 32)


@pytest.mark.parametrize("T", [1, 5, 40])
def test_reference_matches_the_block_float64(T):
    """fused_moe_reference (the kernels' arithmetic) is the MoE block's output: same routing, same weights."""
    cfg = MoEModelConfig(hidden_size=32, num_experts=7, num_experts_per_tok=3, moe_intermediate_size=24)
    block = SparseMoEBlock(cfg, experts_impl="loop").double()
    gen = torch.Generator().manual_seed(T)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
        x_TD = torch.randn(T, 32, generator=gen, dtype=torch.float64)
        want = block(x_TD)
        routed = block.gate(x_TD)
        got = fused_moe_reference(x_TD, routed.topk_idx_TK, routed.topk_weights_TK, block.experts.gate_up_proj,
                                  block.experts.down_proj)
    torch.testing.assert_close(got, want.out_TD, rtol=1e-12, atol=1e-12)


def test_block_path_choice_on_cpu():
    """On a CPU auto never takes the fused path (it needs CUDA and triton); forcing it is a one-line error."""
    cfg = MoEModelConfig(hidden_size=32, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16)
    auto = SparseMoEBlock(cfg)
    with torch.no_grad():
        auto.gate.weight.normal_(0, 0.1)
        for p in auto.experts.parameters():
            p.normal_(0, 0.1)
        x_TD = torch.randn(5, 32)
        out = auto(x_TD).out_TD
        loop = SparseMoEBlock(cfg, experts_impl="loop")
        loop.load_state_dict(auto.state_dict())
        torch.testing.assert_close(out, loop(x_TD).out_TD)
        auto.experts.impl = "fused"
        with pytest.raises(ValueError, match="^experts_impl='fused' cannot run here: [^\n]*$"):
            auto(x_TD)
