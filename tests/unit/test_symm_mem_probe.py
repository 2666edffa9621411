"""symm_mem backend on a CPU-only machine: the probe explains why it cannot run, make_dispatcher refuses
with that reason, and SymmMemDispatcher's own logic (layout, compaction, autograd, buffer alternation)
matches LocalDispatcher when the two NVSHMEM ops are replaced by CPU emulations of their documented
semantics over gloo (the real ops are checked by scripts/multi_gpu/symm_mem_check.py on GPUs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moerl.ep import BackendUnavailable, make_dispatcher
from moerl.ep.dispatcher import LocalDispatcher
from moerl.ep.symm_mem import SymmMemDispatcher, symm_mem_unavailable_reason

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_harness import run_ranks  # noqa: E402

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")


@needs_cpu_only
def test_probe_names_cuda():
    reason = symm_mem_unavailable_reason()
    assert isinstance(reason, str) and "CUDA" in reason


@needs_cpu_only
def test_make_dispatcher_refuses_with_the_reason(tmp_path):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert isinstance(symm_mem_unavailable_reason(dist.group.WORLD), str)
        with pytest.raises(BackendUnavailable, match="symm_mem.*CUDA"):
            make_dispatcher("symm_mem", 8, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@pytest.fixture
def nccl_where_symm_mem_works(monkeypatch):
    """An EP group of 2 NCCL ranks on which the probe finds NVSHMEM working (no process group is made: the
    choice is made before any collective)."""
    import moerl.ep.symm_mem as sm

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(sm, "symm_mem_unavailable_reason", lambda group=None, num_experts=0: None)
    return sm


def test_auto_never_picks_symm_mem(nccl_where_symm_mem_works, monkeypatch):
    from moerl.ep.all_to_all import AllToAllDispatcher

    # symm_mem has not run on two GPUs: `auto` (what `moerl train` passes by default) must not pick it
    assert type(make_dispatcher("auto", 8, object())) is AllToAllDispatcher
    assert type(make_dispatcher("auto", 8, None)) is LocalDispatcher
    # it stays available by name
    monkeypatch.setattr(nccl_where_symm_mem_works, "SymmMemDispatcher", lambda n, g: ("symm_mem", n))
    assert make_dispatcher("symm_mem", 8, object()) == ("symm_mem", 8)


def test_shipped_configs_use_no_symm_mem():
    from moerl.config import load_config

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))
    assert configs
    for path in configs:
        assert load_config(path, []).model.dispatcher in ("auto", "local", "all_to_all"), path.name


# ------------------------------------------------ the dispatcher's logic, with emulated ops (gloo, float64)
E, K, D = 6, 2, 5


def _group(name):
    return dist.distributed_c10d._resolve_process_group(name)


def _emu_all_to_all_vdev_2d(inp, out, in_splits, out_so, group_name, major_align=None):
    """all_to_all_vdev_2d: rank-major input chunks -> expert-major output; each expert segment starts
    aligned to major_align (default 1) and is at least major_align rows long, even when empty."""
    g = _group(group_name)
    P = dist.get_world_size(g)
    L = in_splits.numel() // P
    A = 1 if major_align is None else major_align
    send_PL = in_splits.view(P, L).clone()
    recv_PL = torch.empty_like(send_PL)
    dist.all_to_all_single(recv_PL, send_PL, group=g)
    s_rows, r_rows = send_PL.sum(1).tolist(), recv_PL.sum(1).tolist()
    recv = inp.new_empty(sum(r_rows), inp.shape[1])
    dist.all_to_all_single(recv, inp[: sum(s_rows)].contiguous(), r_rows, s_rows, group=g)
    start = (torch.cumsum(recv_PL.flatten(), 0) - recv_PL.flatten()).view(P, L)
    off, splits, offs = 0, [], []
    for e in range(L):
        seg = off
        for p in range(P):
            n = int(recv_PL[p, e])
            out[off : off + n] = recv[int(start[p, e]) : int(start[p, e]) + n]
            splits.append(n), offs.append(off)
            off += n
        size = max(-(-(off - seg) // A) * A, A) if A else off - seg
        out[off : seg + size] = float("nan")  # padding: garbage that must never be read
        off = seg + size
    out_so[0].copy_(torch.tensor(splits))
    out_so[1].copy_(torch.tensor(offs))


def _emu_all_to_all_vdev_2d_offset(inp, out, in_so, out_so, group_name):
    """all_to_all_vdev_2d_offset: expert-major chunks at given offsets -> rank-major, contiguous."""
    g = _group(group_name)
    P = dist.get_world_size(g)
    L = in_so.shape[1] // P
    splits, offs = in_so[0].view(L, P), in_so[1].view(L, P)
    chunks = [inp[int(offs[e, p]) : int(offs[e, p] + splits[e, p])] for p in range(P) for e in range(L)]
    send_PL = splits.t().contiguous()
    recv_PL = torch.empty_like(send_PL)
    dist.all_to_all_single(recv_PL, send_PL, group=g)
    s_rows, r_rows = send_PL.sum(1).tolist(), recv_PL.sum(1).tolist()
    recv = inp.new_empty(sum(r_rows), inp.shape[1])
    dist.all_to_all_single(recv, torch.cat(chunks), r_rows, s_rows, group=g)
    out[: recv.shape[0]] = recv
    out_so[0].copy_(recv_PL.flatten())
    out_so[1].copy_(torch.cumsum(recv_PL.flatten(), 0) - recv_PL.flatten())


def _install_emulation(lib_holder: list) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    lib = torch.library.Library("symm_mem", "IMPL")
    lib.impl("all_to_all_vdev_2d", _emu_all_to_all_vdev_2d, "CPU")
    lib.impl("all_to_all_vdev_2d_offset", _emu_all_to_all_vdev_2d_offset, "CPU")
    lib_holder.append(lib)  # the registration lives as long as the Library object
    def empty(*size, dtype=None, device=None):  # uninitialised memory: NaN (or -1 for the int64 splits)
        return torch.full(size, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)

    symm_mem.empty = empty
    symm_mem.rendezvous = lambda tensor, group: None
    symm_mem.enable_symm_mem_for_group = lambda name: None


def _case(seed: int, P: int, Ts: list[int], may_drop: bool):
    """Every rank's inputs (all ranks build all of them): uneven T, experts 1 and E-1 never chosen."""
    gen = torch.Generator().manual_seed(seed)
    avail = torch.tensor([e for e in range(E) if e not in (1, E - 1)])
    out = []
    for T in Ts:
        idx = avail[torch.rand(T, len(avail), generator=gen).argsort(-1)[:, :K]]
        if may_drop:
            idx = torch.where(torch.rand(T, K, generator=gen) < 0.3, -1, idx)
        out.append((torch.randn(T, D, generator=gen, dtype=torch.float64), idx,
                    torch.rand(T, K, generator=gen, dtype=torch.float64), torch.randn(T, D, generator=gen, dtype=torch.float64)))
    return out


def _experts(x_ND, counts_L, W_LDD):
    """Expert e's linear map on its segment; rows past counts_L.sum() map to zero (no host sync)."""
    pad = x_ND.shape[0] - counts_L.sum()
    ids = torch.repeat_interleave(torch.arange(W_LDD.shape[0] + 1), torch.cat([counts_L, pad.view(1)]),
                                  output_size=x_ND.shape[0])
    W = torch.cat([W_LDD, W_LDD.new_zeros(1, D, D)])
    return torch.tanh(torch.bmm(W[ids], x_ND.unsqueeze(-1)).squeeze(-1))


def _run(disp, x, idx, w, W, cot):
    x, w, W = (t.clone().requires_grad_() for t in (x, w, W))
    x_ND, counts_L, h = disp.dispatch(x, idx, w)
    out = disp.combine(_experts(x_ND, counts_L, W), h)
    (out * cot).sum().backward()
    return x_ND.detach(), counts_L, out.detach(), x.grad, w.grad, W.grad


def emulated_worker(rank: int, world_size: int) -> None:
    libs: list = []
    _install_emulation(libs)
    P, L = world_size, E // world_size
    group = dist.group.WORLD
    disp = SymmMemDispatcher(E, group)
    W_all = torch.randn(E, D, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sl = slice(rank * L, (rank + 1) * L)
    # T grows between cases (buffers re-allocated); one rank may have no tokens; drops on the last case.
    for seed, Ts, may_drop in ((1, [5, 3, 7], False), (2, [11, 0, 9], False), (3, [20, 17, 6], True)):
        Ts = Ts[:P]
        disp.may_drop = may_drop
        data = _case(seed, P, Ts, may_drop)
        ref = LocalDispatcher(E)
        ref.may_drop = may_drop
        cat = [torch.cat([d[i] for d in data]) for i in range(4)]
        r_xND, r_counts, r_out, r_gx, r_gw, r_gW = _run(ref, cat[0], cat[1], cat[2], W_all, cat[3])
        x, idx, w, cot = data[rank]
        x_ND, counts_L, out, gx, gw, gW = _run(disp, x, idx, w, W_all[sl], cot)
        assert torch.equal(counts_L, r_counts[sl])
        n, lo = int(counts_L.sum()), int(r_counts[: rank * L].sum())
        torch.testing.assert_close(x_ND[:n], r_xND[lo : lo + n])
        assert x_ND.shape[0] == P * max(Ts) * K and torch.all(x_ND[n:] == 0)
        t0, t1 = sum(Ts[:rank]), sum(Ts[: rank + 1])
        for got, want in ((out, r_out[t0:t1]), (gx, r_gx[t0:t1]), (gw, r_gw[t0:t1]), (gW, r_gW[sl])):
            torch.testing.assert_close(got, want)
    # Fixed capacity (re-allocates once, to 24 tokens per rank), and two dispatches in flight
    # (dispatch, dispatch, combine, combine): each handle keeps its own route.
    disp.may_drop, disp.max_tokens = False, 24
    a, b = _case(4, P, [4, 6, 2][:P], False), _case(5, P, [7, 1, 3][:P], False)
    xa, ca, ha = disp.dispatch(a[rank][0], a[rank][1], a[rank][2])
    xb, cb, hb = disp.dispatch(b[rank][0], b[rank][1], b[rank][2])
    out_b = disp.combine(_experts(xb, cb, W_all[sl]), hb)
    out_a = disp.combine(_experts(xa, ca, W_all[sl]), ha)
    for d, got in ((a, out_a), (b, out_b)):
        ref = LocalDispatcher(E)
        cat = [torch.cat([r[i] for r in d]) for i in range(3)]
        x_ND, c, h = ref.dispatch(*cat)
        want = ref.combine(_experts(x_ND, c, W_all), h)
        t0 = sum(r[0].shape[0] for r in d[:rank])
        torch.testing.assert_close(got, want[t0 : t0 + d[rank][0].shape[0]])
    assert disp.bufs.cap >= 24 and xa.shape[0] == P * 24 * K


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 3])
def test_dispatcher_logic_with_emulated_ops(world_size):
    run_ranks(world_size, emulated_worker)
