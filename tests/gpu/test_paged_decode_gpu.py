"""The paged decode path: the Triton kernel (moerl/kernels/triton_paged.py) against `paged_decode_reference` in
float64, eagerly and replayed in a CUDA graph; and the rollout engine decoding with it.

Shape legend: B rows, H query heads, G key/value heads, d head size, N blocks in the pool, P positions per block,
W blocks per row of the block table.

Kernel: float64, float32 and bf16 inputs for several block sizes, GQA ratios and row lengths (1 to the table's
full width), compared by ||got - want|| / ||want|| with the reference on the unrounded float64 inputs. Every pool
slot a row may not read (blocks outside the table, positions at or past a row's length) holds NaN, so a read past
a row's length shows. The kernel allocates its output (nothing to poison eagerly); in the graph the static output
is NaN-filled before the replay that must overwrite it.
Engine: a float32 tiny model generates with the paged kernel (eagerly: float32's MoE loop reads expert counts on
the host, so it cannot be captured) and is checked against a plain loop of full forwards; the same model in bf16
decodes in CUDA graphs and is checked against the eager engine. Timings: `moerl bench paged-decode`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_helpers import rel_err

from moerl.kernels import paged_decode_reference
from moerl.model import MoEModelConfig, build_model
from moerl.rollout import Engine, EngineConfig, SamplingParams

# (B, H, G, d, P, W): GQA 8:1, 1:1, 8:1 with an odd head size, 4:1 with tiny heads; blocks of 16, 32, 4, 16
SHAPES = [(5, 32, 4, 128, 16, 12), (3, 8, 8, 64, 32, 5), (4, 16, 2, 96, 4, 20), (1, 4, 1, 8, 16, 3)]
SHAPE_IDS = ["B5-H32-G4-d128-P16", "B3-H8-G8-d64-P32", "B4-H16-G2-d96-P4", "B1-H4-G1-d8-P16"]
# float32 seen <= 1.6e-6 max abs on an H200 (BENCHMARKS.md); bf16 ~2e-3 relative: q, k, v and p rounded to bf16
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def no_tf32(device, monkeypatch):
    """float32 bounds mean float32 GEMMs (the engine's float32 model), whatever an earlier test set."""
    if device.type == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def paged_inputs(B: int, H: int, G: int, d: int, P: int, W: int, seed: int):
    """float64 q and k/v pools, each row's W blocks in random order (blocks 0 and two spares in no row), lengths
    from 1 to W * P: the first row 1, the last the table's full width."""
    gen = torch.Generator().manual_seed(seed)
    N = B * W + 3
    q_BHd = torch.randn(B, H, d, generator=gen, dtype=torch.float64)
    k_NGPd, v_NGPd = (torch.randn(N, G, P, d, generator=gen, dtype=torch.float64) for _ in range(2))
    table_BW = torch.randperm(N - 1, generator=gen)[: B * W].view(B, W) + 1
    seq_len_B = torch.randint(1, W * P + 1, (B,), generator=gen)
    seq_len_B[0], seq_len_B[-1] = 1, W * P
    return q_BHd, k_NGPd, v_NGPd, table_BW, seq_len_B


def poison_unread_(k_NGPd: torch.Tensor, v_NGPd: torch.Tensor, table_BW: torch.Tensor,
                   seq_len_B: torch.Tensor) -> None:
    """NaN (in place) into every pool slot that no row may read: the reference masks those, the kernel must not
    load them (a NaN loaded at any weight makes the row NaN)."""
    N, _, P, _ = k_NGPd.shape
    W = table_BW.shape[1]
    pos_S = torch.arange(W * P, device=table_BW.device)
    live_BS = pos_S[None, :] < seq_len_B[:, None]
    readable_NP = torch.zeros(N, P, dtype=torch.bool, device=table_BW.device)
    readable_NP[table_BW[:, pos_S // P][live_BS], (pos_S % P).expand_as(live_BS)[live_BS]] = True
    for pool in (k_NGPd, v_NGPd):
        pool.masked_fill_(~readable_NP[:, None, :, None], float("nan"))


@pytest.mark.cuda_only
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_paged_decode_kernel_matches_float64(device, shape, dtype):
    from moerl.kernels.triton_paged import paged_decode

    seed = SHAPES.index(shape) * 10 + [torch.float64, torch.float32, torch.bfloat16].index(dtype)
    q_BHd, k_NGPd, v_NGPd, table_BW, seq_len_B = paged_inputs(*shape, seed=seed)
    want_BHd = paged_decode_reference(q_BHd, k_NGPd, v_NGPd, table_BW, seq_len_B)
    k_lp, v_lp = k_NGPd.to(dtype, copy=True), v_NGPd.to(dtype, copy=True)
    poison_unread_(k_lp, v_lp, table_BW, seq_len_B)
    got_BHd = paged_decode(q_BHd.to(device, dtype), k_lp.to(device), v_lp.to(device), table_BW.to(device),
                           seq_len_B.to(device))
    assert got_BHd.dtype == dtype and got_BHd.shape == q_BHd.shape
    err = rel_err(got_BHd, want_BHd)
    assert err <= TOL[dtype], f"{dtype}: rel. error {err:.1e}"


@pytest.mark.cuda_only
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_paged_decode_kernel_in_cuda_graph_reads_new_tables_and_lengths(device, shape):
    """Captured once, replayed after new block tables and lengths were written into the captured buffers: the
    loop bounds come from the device, so rows now longer than at capture read their new positions, and only those
    (the rest of the pool is NaN by then)."""
    from moerl.kernels.triton_paged import paged_decode

    B, _, _, _, P, W = shape
    q_BHd, k_NGPd, v_NGPd, table_BW, seq_len_B = paged_inputs(*shape, seed=100 + SHAPES.index(shape))
    args = [x.to(device=device, dtype=torch.float32) for x in (q_BHd, k_NGPd, v_NGPd)] + [table_BW.to(device),
                                                                                         seq_len_B.to(device)]
    paged_decode(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_BHd = paged_decode(*args)
    new_table_BW = table_BW.flip(0)
    new_seq_len_B = torch.randint(1, W * P + 1, (B,), generator=torch.Generator().manual_seed(200 + B))
    new_seq_len_B[-1], new_seq_len_B[0] = 1, W * P  # the extremes swapped: row 0 went from 1 to the full width
    args[3].copy_(new_table_BW)
    args[4].copy_(new_seq_len_B)
    poison_unread_(args[1], args[2], args[3], args[4])
    out_BHd.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    err = rel_err(out_BHd, paged_decode_reference(q_BHd, k_NGPd, v_NGPd, new_table_BW, new_seq_len_B))
    assert err <= TOL[torch.float32], f"rel. error {err:.1e} after replay with new tables and lengths"


# ------------------------------------------------------------------------------------------------- the engine

ARCH = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
            mlp_only_layers=[1], initializer_range=0.1)
NEW_TOKENS = 20


def prompts() -> list[list[int]]:
    """Lengths around the block sizes (16 and 4) and the prefill chunk (7); each twice (shared prompt blocks).
    Model seed 0 and these prompts are the former scripts/gpu/paged_decode_check.py's, which passed on an H200 (the
    equalities below have no tolerance: a near-tie of two logits or router scores would need another seed)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, ARCH["vocab_size"], (n,), generator=gen).tolist() for n in (1, 5, 11, 16, 17, 33)] * 2


def engine_config(block_size: int, cuda_graphs: bool) -> EngineConfig:
    return EngineConfig(max_batch_size=4, max_seq_len=64, kv_block_size=block_size, cuda_graphs=cuda_graphs,
                        prefill_chunk=7)


@pytest.mark.parametrize("block_size", [16, 4])
def test_engine_float32_matches_full_forwards(device, block_size):
    """Greedy tokens equal to a loop of full forwards (one per new token), the routing of every position equal to
    a full forward's, and the log-probs within 1e-5 (relative) of a float64 copy's full forward on that routing.
    On CUDA decode attends with the Triton kernel (the engine's own startup check accepted it); on the CPU with
    the reference."""
    model = build_model(MoEModelConfig(**ARCH), device=device, seed=0).eval()
    model64 = copy.deepcopy(model).double()
    ps = prompts()
    engine = Engine(model, engine_config(block_size, cuda_graphs=False))
    assert engine.cache.decode_kernel == (device.type == "cuda")
    outs = engine.generate(ps, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0))
    assert engine.stats["decode_steps"] > 0
    got, want = [], []
    with torch.no_grad():
        for prompt, c in zip(ps, outs, strict=True):
            tokens = list(prompt)
            for _ in range(NEW_TOKENS):
                tokens.append(int(model(torch.tensor([tokens], device=device))[0, -1].argmax()))
            assert c.token_ids == tokens[len(prompt):], f"prompt of {len(prompt)} tokens"
            ids_1T = torch.tensor([tokens[:-1]], device=device)
            routed_TLK = c.routed_experts.long()
            assert torch.equal(routed_TLK, model.forward_full(ids_1T).routed_experts_BTLK[0].cpu())
            logits_TV = model64.forward_full(ids_1T, routed_experts_BTLK=routed_TLK[None].to(device)).logits_BTV[0]
            logp_TV = torch.log_softmax(logits_TV[len(prompt) - 1:], dim=-1)
            want.append(logp_TV.gather(1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0])
            got.append(torch.tensor(c.logprobs, dtype=torch.float64))
    err = rel_err(torch.cat(got), torch.cat(want))
    assert err <= 1e-5, f"log-probs: rel. error {err:.1e} against float64 full forwards"


@pytest.mark.cuda_only
def test_engine_bf16_cuda_graphs_match_eager(device):
    """bf16 decodes in CUDA graphs (one per batch-size bucket): every capture succeeds and the replayed steps give
    the eager engine's completions. Bucket padding may change a GEMM's reduction order, so up to two of the 12
    completions may part on a near-tie, and the log-probs of the equal ones agree within 5e-2."""
    model = build_model(MoEModelConfig(**ARCH), device=device, seed=0, dtype=torch.bfloat16).eval()
    ps, params = prompts(), SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    graphed = Engine(model, engine_config(16, cuda_graphs=True))
    outs = graphed.generate(ps, params)
    eager_engine = Engine(model, engine_config(16, cuda_graphs=False))
    eager = eager_engine.generate(ps, params)
    assert eager_engine.graphs is None
    assert graphed.graphs.disabled_reason is None, f"capture failed: {graphed.graphs.disabled_reason}"
    assert graphed.graphs.captured, "no decode step was captured"
    assert graphed.cache.decode_kernel  # the graphs replay the Triton paged kernel
    same = [a.token_ids == b.token_ids for a, b in zip(outs, eager, strict=True)]
    assert sum(same) >= len(same) - 2, f"{sum(same)}/{len(same)} completions equal to eager"
    assert all(len(c.token_ids) == NEW_TOKENS for c in outs)
    diff = max(float((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max())
               for a, b, s in zip(outs, eager, same) if s)
    assert diff <= 5e-2, f"log-probs of equal completions differ by up to {diff:.1e}"
