"""Check SymmMemDispatcher (NVSHMEM) against LocalDispatcher and the all_to_all backend on GPUs.

Its point is two GPUs or more (one host), so it is not in the GPU suite (`make test-gpu` runs on one lent H200);
tests/unit/test_symm_mem_probe.py checks the probe's semantics over gloo, and `moerl bench dispatch` times the
backends (world size 1 on one GPU, or under torchrun).

    python scripts/multi_gpu/symm_mem_check.py                              # one GPU, world size 1
    torchrun --nproc-per-node=N scripts/multi_gpu/symm_mem_check.py         # N GPUs of one host (N <= 16)

For float32 and bfloat16: dispatch -> per-expert linear (+tanh) -> combine, outputs and the gradients
of the tokens, the router weights and the expert weights, on random inputs with uneven tokens per rank,
unused experts, a skewed load, dropped pairs, buffer growth, a fixed capacity, two dispatches in flight,
and no host sync in the steady state (torch.cuda.set_sync_debug_mode("error")). Every line is PASS, FAIL or
SKIP; exit status 0 all passed, 1 something failed, 2 symm_mem unavailable here (the reason is printed).
Imports only torch and moerl.ep.
"""

import os

# NVLink multicast must stay off on the lent machines: set before torch (and NCCL/NVSHMEM) load.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a plain checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moerl.ep import make_dispatcher  # noqa: E402
from moerl.ep.dispatcher import LocalDispatcher  # noqa: E402
from moerl.ep.symm_mem import symm_mem_unavailable_reason  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
RESULTS = {"fail": 0}


def init() -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # one process: world size 1 on a free local port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(s.getsockname()[1]))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=5))
    return dist.get_rank(), dist.get_world_size(), device


def report(name: str, ok: bool, err: float, device) -> None:
    """One line per check from rank 0, with the worst error over the ranks."""
    t = torch.tensor([0.0 if ok else 1.0, err], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    failed = bool(t[0] > 0)
    RESULTS["fail"] += failed
    if dist.get_rank() == 0:
        print(f"{'FAIL' if failed else 'PASS'} {name}  (max |diff| {float(t[1]):.3g})", flush=True)


def compare(name, got: dict, want: dict, dtype, device) -> None:
    ok, err = True, 0.0
    for k in want:
        g, w = got[k].float(), want[k].float()
        if g.shape != w.shape:
            ok, err = False, float("inf")
            continue
        if g.numel():
            err = max(err, float((g - w).abs().max()))
            ok &= bool(torch.isclose(g, w, **TOL[dtype]).all())
    report(name, ok, err, device)


def make_case(seed, Ts, E, K, D, dtype, device, skew=False, drop=False):
    """Inputs of every rank (all ranks build all of them, same generator): x, topk_idx, weights, cotangent."""
    gen = torch.Generator().manual_seed(seed)
    unused = set(range(0, E, 3)) if skew and E - len(range(0, E, 3)) >= K else set()
    avail = torch.tensor([e for e in range(E) if e not in unused])
    prob = torch.ones(len(avail))
    if skew:
        prob[0] = 8 * len(avail)  # one hot expert
    out = []
    for T in Ts:
        idx = avail[torch.multinomial(prob.expand(T, -1), K, replacement=False, generator=gen)] if T else \
            torch.zeros(0, K, dtype=torch.long)
        if drop:
            idx = torch.where(torch.rand(T, K, generator=gen) < 0.25, -1, idx)
        x = torch.randn(T, D, generator=gen)
        w = torch.softmax(torch.randn(T, K, generator=gen), -1)
        cot = torch.randn(T, D, generator=gen)
        out.append([x.to(device, dtype), idx.to(device), w.to(device, dtype), cot.to(device, dtype)])
    return out


def experts(x_ND, counts_L, W_LDD, check_padding=None):
    """tanh(x @ W[e]) on expert e's segment; zero rows past the counts (padding, never read by combine)."""
    pieces, o = [], 0
    for e, n in enumerate(counts_L.tolist()):
        pieces.append(torch.tanh(x_ND[o : o + n] @ W_LDD[e]))
        o += n
    if check_padding is not None:
        check_padding.append(bool((x_ND[o:] == 0).all()))
    if x_ND.shape[0] > o:
        pieces.append(x_ND.new_zeros(x_ND.shape[0] - o, x_ND.shape[1]))
    return torch.cat(pieces)


def run(disp, x, idx, w, W, cot, padding=None):
    x, w, W = (t.detach().clone().requires_grad_() for t in (x, w, W))
    x_ND, counts_L, h = disp.dispatch(x, idx, w)
    out = disp.combine(experts(x_ND, counts_L, W, padding), h)
    (out.float() * cot.float()).sum().backward()
    return dict(out=out.detach(), gx=x.grad, gw=w.grad, gW=W.grad, counts=counts_L)


def check_case(label, disps, case, W_all, rank, L, dtype, device, drop=False):
    ref = LocalDispatcher(W_all.shape[0])
    ref.may_drop = drop
    glob = [torch.cat([c[i] for c in case]) for i in range(4)]
    want = run(ref, glob[0], glob[1], glob[2], W_all, glob[3])
    t0, t1, sl = sum(c[0].shape[0] for c in case[:rank]), sum(c[0].shape[0] for c in case[: rank + 1]), \
        slice(rank * L, (rank + 1) * L)
    want = dict(out=want["out"][t0:t1], gx=want["gx"][t0:t1], gw=want["gw"][t0:t1], gW=want["gW"][sl],
                counts=want["counts"][sl])
    x, idx, w, cot = case[rank]
    for name, disp in disps.items():
        disp.may_drop = drop
        padding: list = []
        try:
            got = run(disp, x, idx, w, W_all[sl], cot, padding)
        except Exception:  # noqa: BLE001 - report and go on (one GPU: no peer left waiting)
            print(f"FAIL [rank {rank}] {name} {label} {dtype}: raised\n{traceback.format_exc()}", flush=True)
            report(f"{name} {label} {dtype}: ran", False, float("inf"), device)
            continue
        compare(f"{name} vs local: {label} {dtype}", got, want, dtype, device)
        report(f"{name} {label} {dtype}: rows past counts_L are zero", all(padding), 0.0, device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts-per-rank", type=int, default=8)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=96, help="base tokens per rank (ranks get uneven counts)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    args = p.parse_args()
    early = symm_mem_unavailable_reason()
    if not torch.cuda.is_available():
        print(f"UNAVAILABLE symm_mem: {early}")
        return 2
    rank, P, device = init()
    L, K, D, T = args.experts_per_rank, args.topk, args.hidden, args.tokens
    E = L * P
    reason = symm_mem_unavailable_reason(dist.group.WORLD, E)
    if rank == 0:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, world size {P}, E={E} K={K} D={D}; "
              f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} TORCH_SYMM_MEM_DISABLE_MULTICAST="
              f"{os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST']} NVSHMEM_DISABLE_NVLS={os.environ['NVSHMEM_DISABLE_NVLS']}")
        print(f"UNAVAILABLE symm_mem: {reason}" if reason else "symm_mem probe: available", flush=True)
    disps = {}
    if reason is None:
        disps["symm_mem"] = make_dispatcher("symm_mem", E, dist.group.WORLD)
    try:
        disps["all_to_all"] = make_dispatcher("all_to_all", E, dist.group.WORLD)
    except ImportError as e:
        print(f"SKIP all_to_all: {e}")
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        W_all = (torch.randn(E, D, D, generator=torch.Generator().manual_seed(0)) / D**0.5).to(device, dtype)
        cases = [  # (label, seed, tokens per rank, skew, drop)
            ("uniform, uneven T", 1, [T + 8 * r for r in range(P)], False, False),
            ("skewed, unused experts, a rank with 1 token", 2, [T // 2 + 3 * r for r in range(P - 1)] + [1], True, False),
            ("larger T (buffers grow)", 3, [3 * T + r for r in range(P)], False, False),
            ("dropped pairs", 4, [T + r for r in range(P)], True, True),
        ]
        for label, seed, Ts, skew, drop in cases:
            case = make_case(seed, Ts, E, K, D, dtype, device, skew, drop)
            check_case(label, disps, case, W_all, rank, L, dtype, device, drop)
        if "symm_mem" not in disps:
            continue
        sm = make_dispatcher("symm_mem", E, dist.group.WORLD)
        sm.max_tokens = 4 * T + P  # fixed capacity: shares (and re-sizes once) the group's buffers
        case = make_case(5, [T + 5 * r for r in range(P)], E, K, D, dtype, device)
        check_case("fixed capacity (max_tokens)", {"symm_mem": sm}, case, W_all, rank, L, dtype, device)
        # Two dispatches in flight: dispatch a, dispatch b, combine b, combine a.
        a, b = (make_case(s, [T + r for r in range(P)], E, K, D, dtype, device) for s in (6, 7))
        sl, ok, err = slice(rank * L, (rank + 1) * L), True, 0.0
        with torch.no_grad():
            xa, ca, ha = sm.dispatch(*a[rank][:3])
            xb, cb, hb = sm.dispatch(*b[rank][:3])
            outs = {"b": sm.combine(experts(xb, cb, W_all[sl]), hb), "a": sm.combine(experts(xa, ca, W_all[sl]), ha)}
            for key, c in (("a", a), ("b", b)):
                ref = LocalDispatcher(E)
                g = [torch.cat([r[i] for r in c]) for i in range(3)]
                x_ND, cnt, h = ref.dispatch(*g)
                t0 = sum(r[0].shape[0] for r in c[:rank])
                want = ref.combine(experts(x_ND, cnt, W_all), h)[t0 : t0 + c[rank][0].shape[0]]
                err = max(err, float((outs[key].float() - want.float()).abs().max()))
                ok &= bool(torch.isclose(outs[key].float(), want.float(), **TOL[dtype]).all())
        report(f"symm_mem two dispatches in flight {dtype}", ok, err, device)
        # No host sync in the steady state: a row-wise expert (no counts read), forward and backward.
        for mode, max_tokens in (("max_tokens", 4 * T + P), ("default", 0)):
            sm.max_tokens = max_tokens
            x, idx, w, cot = case[rank]
            x = x.clone().requires_grad_()
            for attempt in range(2):  # the first call may (re)allocate: a sync is allowed there
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error" if attempt else 0)
                try:
                    x_ND, _, h = sm.dispatch(x, idx, w)
                    (sm.combine(torch.tanh(1.5 * x_ND), h) * cot).sum().backward()
                    ok, msg = True, ""
                except RuntimeError as e:
                    ok, msg = False, str(e).splitlines()[0]
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            if not ok:
                print(f"[rank {rank}] host sync: {msg}", flush=True)
            report(f"symm_mem no host sync in the steady state ({mode}) {dtype}", ok, 0.0, device)
    if rank == 0:
        print(f"{'ALL PASSED' if RESULTS['fail'] == 0 else str(RESULTS['fail']) + ' FAILED'}"
              f"{'' if reason is None else ' (symm_mem not run: ' + reason + ')'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if RESULTS["fail"] else (2 if reason else 0)


if __name__ == "__main__":
    sys.exit(main())
