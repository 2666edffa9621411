"""AllToAllDispatcher on 2 and 4 gloo ranks against the single-process reference.

Workers (module-level functions, run in spawned processes) do the expert-parallel computation and save
what they saw; the test process recomputes everything on one process and compares.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_harness import preload, run_ranks
from moerl.ep import make_dispatcher
from moerl.ep.all_to_all import AllToAllDispatcher
from moerl.ep.dispatcher import LocalDispatcher
from moerl.ep.permute import count_per_expert
from moerl.model import build_model, load_pretrained, save_pretrained, tiny_config

pytestmark = pytest.mark.distributed
WORLD_SIZES = [2, 4]

# ---------------------------------------------------------------- dispatcher level (float64)
E, K, D = 8, 2, 6


@pytest.fixture(scope="module", autouse=True)
def forkserver() -> None:
    preload("moerl.model", "moerl.ep", __name__)


# (may_drop, tokens per rank): uneven counts, a rank with no tokens first and last, dropped pairs.
DISPATCH_CASES = {
    2: [(False, [13, 9]), (False, [0, 13]), (True, [10, 12])],
    4: [(False, [11, 7, 17, 0]), (False, [0, 5, 9, 12]), (True, [6, 13, 0, 8])],
}


def dispatcher_case(rank: int, world_size: int, case: int):
    """Rank `rank`'s tokens, routing, weights and output cotangent. Some experts are never chosen:
    expert 1, the last expert and, with 4 ranks, all of rank 1's experts (it receives no rows)."""
    may_drop, tokens = DISPATCH_CASES[world_size][case]
    gen = torch.Generator().manual_seed(100 * world_size + 10 * case + rank)
    T = tokens[rank]
    unused = {1, E - 1} | ({2, 3} if world_size == 4 else set())
    avail = torch.tensor([e for e in range(E) if e not in unused])
    idx_TK = avail[torch.rand(T, len(avail), generator=gen).argsort(-1)[:, :K]]
    if may_drop:
        idx_TK = torch.where(torch.rand(T, K, generator=gen) < 0.3, -1, idx_TK)
    x_TD = torch.randn(T, D, generator=gen, dtype=torch.float64)
    w_TK = torch.rand(T, K, generator=gen, dtype=torch.float64)
    cot_TD = torch.randn(T, D, generator=gen, dtype=torch.float64)
    return x_TD, idx_TK, w_TK, cot_TD


def expert_weights() -> torch.Tensor:
    return torch.randn(E, D, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def apply_experts(x_ND: torch.Tensor, counts_L: torch.Tensor, W_LDD: torch.Tensor) -> torch.Tensor:
    """Row n goes through expert e(n)'s linear map; rows are grouped by expert as counts_L says."""
    expert_N = torch.repeat_interleave(torch.arange(W_LDD.shape[0]), counts_L, output_size=x_ND.shape[0])
    return torch.bmm(W_LDD[expert_N], x_ND.unsqueeze(-1)).squeeze(-1)


def run_dispatch(disp, x_TD, idx_TK, w_TK, W_LDD, cot_TD):
    x_TD, w_TK, W_LDD = (t.clone().requires_grad_() for t in (x_TD, w_TK, W_LDD))
    x_ND, counts_L, handle = disp.dispatch(x_TD, idx_TK, w_TK)
    out_TD = disp.combine(apply_experts(x_ND, counts_L, W_LDD), handle)
    (out_TD * cot_TD).sum().backward()
    return dict(out=out_TD.detach(), counts=counts_L, gx=x_TD.grad, gw=w_TK.grad, gW=W_LDD.grad)


def dispatcher_worker(rank: int, world_size: int, out_dir: str) -> None:
    disp = make_dispatcher("all_to_all", E, dist.group.WORLD)
    assert isinstance(disp, AllToAllDispatcher)
    results = []
    for case, (may_drop, _) in enumerate(DISPATCH_CASES[world_size]):
        disp.may_drop = may_drop
        x_TD, idx_TK, w_TK, cot_TD = dispatcher_case(rank, world_size, case)
        W_LDD = expert_weights()[disp.local_expert_slice]
        results.append(run_dispatch(disp, x_TD, idx_TK, w_TK, W_LDD, cot_TD))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dispatcher_matches_local(world_size, tmp_path):
    run_ranks(world_size, dispatcher_worker, str(tmp_path))
    L = E // world_size
    for case, (may_drop, _) in enumerate(DISPATCH_CASES[world_size]):
        ref = LocalDispatcher(E)
        ref.may_drop = may_drop
        gW_sum, counts_sum = torch.zeros(E, D, D, dtype=torch.float64), torch.zeros(E, dtype=torch.long)
        got = [torch.load(tmp_path / f"rank{r}.pt")[case] for r in range(world_size)]
        for r in range(world_size):
            x_TD, idx_TK, w_TK, cot_TD = dispatcher_case(r, world_size, case)
            want = run_dispatch(ref, x_TD, idx_TK, w_TK, expert_weights(), cot_TD)
            for key in ("out", "gx", "gw"):
                torch.testing.assert_close(got[r][key], want[key], msg=lambda m: f"case {case} rank {r} {key}: {m}")
            gW_sum += want["gW"]
            counts_sum += count_per_expert(idx_TK, E)
        assert counts_sum[1] == counts_sum[E - 1] == 0  # experts with no rows
        assert counts_sum[L : 2 * L].sum() == 0 or world_size == 2  # with 4 ranks, rank 1 receives nothing
        for r in range(world_size):
            torch.testing.assert_close(got[r]["counts"], counts_sum[r * L : (r + 1) * L], rtol=0, atol=0)
            torch.testing.assert_close(got[r]["gW"], gW_sum[r * L : (r + 1) * L],
                                       msg=lambda m: f"case {case} rank {r} expert grads: {m}")


# ---------------------------------------------------------------- model level (float32)
def small_config(**overrides):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                mlp_only_layers=[1])
    return tiny_config(**{**base, **overrides})


def model_batch(rank: int, vocab: int = 64):
    """Rank r's batch (ids, loss cotangent on the logits): a different length on every rank."""
    gen = torch.Generator().manual_seed(1000 + rank)
    ids_BT = torch.randint(0, vocab, (2, 5 + 3 * rank), generator=gen)
    return ids_BT, torch.randn(*ids_BT.shape, vocab, generator=gen)


def is_expert_param(name: str) -> bool:
    return name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj")


def model_worker(rank: int, world_size: int, ckpt: str, out_dir: str, capacity_factor: float) -> None:
    model = load_pretrained(ckpt, expert_parallel_group=dist.group.WORLD, dispatcher="all_to_all",
                            capacity_factor=capacity_factor)
    assert all(isinstance(b.dispatcher, AllToAllDispatcher) for b in model.moe_blocks)
    ids_BT, cot_BTV = model_batch(rank)
    out = model.forward_full(ids_BT)
    (out.logits_BTV * cot_BTV).sum().backward()  # the loss summed over ranks: each rank backprops its share
    with torch.no_grad():
        replay = model.forward_full(ids_BT, routed_experts_BTLK=out.routed_experts_BTLK).logits_BTV
    grads = {n: p.grad for n, p in model.named_parameters()}
    torch.save(dict(logits=out.logits_BTV.detach(), routed=out.routed_experts_BTLK, replay=replay, grads=grads),
               Path(out_dir) / f"rank{rank}.pt")


def assert_close_scaled(got, want, what: str, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """float32 comparison with atol relative to the largest entry: the tensors' scales differ a lot."""
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


def check_model_against_single_process(world_size, tmp_path, capacity_factor):
    ckpt = tmp_path / "ckpt"
    save_pretrained(build_model(small_config(), seed=0), ckpt)
    run_ranks(world_size, model_worker, str(ckpt), str(tmp_path), capacity_factor)
    ref = load_pretrained(ckpt, capacity_factor=capacity_factor)
    expert_grads = {n: torch.zeros_like(p) for n, p in ref.named_parameters() if is_expert_param(n)}
    L = ref.config.num_experts // world_size
    for r in range(world_size):
        got = torch.load(tmp_path / f"rank{r}.pt")
        ref.zero_grad(set_to_none=True)
        ids_BT, cot_BTV = model_batch(r)
        out = ref.forward_full(ids_BT)
        (out.logits_BTV * cot_BTV).sum().backward()
        assert_close_scaled(got["logits"], out.logits_BTV.detach(), f"rank {r} logits")
        assert torch.equal(got["routed"], out.routed_experts_BTLK)
        assert torch.equal(got["replay"], got["logits"]), "routing replay through EP changed the logits"
        for name, p in ref.named_parameters():
            if is_expert_param(name):
                expert_grads[name] += p.grad
            else:  # non-expert parameters see only this rank's batch
                assert_close_scaled(got["grads"][name], p.grad, f"rank {r} {name}", rtol=1e-4)
    for r in range(world_size):
        got = torch.load(tmp_path / f"rank{r}.pt")["grads"]
        for name, g in expert_grads.items():  # experts see every rank's tokens
            assert_close_scaled(got[name], g[r * L : (r + 1) * L], f"rank {r} {name}", rtol=1e-4)
    return ref, ckpt


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_model_matches_single_process(world_size, tmp_path):
    check_model_against_single_process(world_size, tmp_path, capacity_factor=0.0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_capacity_factor_drops_match_single_process(world_size, tmp_path):
    ref, ckpt = check_model_against_single_process(world_size, tmp_path, capacity_factor=1.0)
    dropless = load_pretrained(ckpt)
    with torch.no_grad():  # the capacity really dropped pairs: otherwise this test proves nothing new
        ids_BT = model_batch(world_size - 1)[0]
        assert not torch.allclose(ref(ids_BT), dropless(ids_BT))


# ---------------------------------------------------------------- errors
def indivisible_worker(rank: int, world_size: int, ckpt: str) -> None:
    bad = 2 * world_size + 1
    for make in (lambda: make_dispatcher("all_to_all", bad, dist.group.WORLD),
                 lambda: make_dispatcher("auto", bad, dist.group.WORLD),
                 lambda: AllToAllDispatcher(bad, dist.group.WORLD),
                 lambda: load_pretrained(ckpt, expert_parallel_group=dist.group.WORLD, dispatcher="all_to_all")):
        with pytest.raises(ValueError, match=f"num_experts={bad} is not divisible by the expert-parallel size"):
            make()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_indivisible_experts_raise(world_size, tmp_path):
    save_pretrained(build_model(small_config(num_experts=2 * world_size + 1), seed=0), tmp_path)
    run_ranks(world_size, indivisible_worker, str(tmp_path))
