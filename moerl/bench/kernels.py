"""`moerl bench kernels`: the small fused kernels against the torch expressions they replace, and torch.compile of
those expressions: RMSNorm and the residual add + RMSNorm without grad (the engine's decode) and forward +
backward (the trainer's step), the router's top-k, and the Gumbel-max sampler.

    python -m moerl.cli bench kernels                    # CUDA: decode shapes (256 rows), the trainer's (32k tokens)
    python -m moerl.cli bench kernels --group decode     # or train, sampler
    python -m moerl.cli bench kernels --no-compile       # without the torch.compile column
    python -m moerl.cli bench kernels --device cpu       # tiny shapes; ours is the torch reference there

Ours is the dispatch the model and the engine call (moerl.kernels.norm's rms_norm and add_rms_norm,
moerl.kernels.router.router_topk, moerl.rollout.sampling.gumbel_argmax): the Triton kernels on CUDA with triton,
the torch references elsewhere. The peer is the torch reference on the same inputs, and torch.compile of it
(fullgraph, static shapes; CUDA only) a second one. No-grad cases are timed per call in a replayed CUDA graph
(--calls calls a graph, as the decode graphs run them: launch gaps gone); forward + backward cases eagerly, CUDA
events around each step. The hardware limit is the fewest bytes a case must move (each input read once, each
output written once: `norm_bytes`, `router_bytes`, `sampler_bytes`) at the device copy bandwidth measured in the
same run. "equal" is the fraction of our output elements (gradients included) bitwise equal to the reference's,
"compile equal" torch.compile's.
Shape legend: R rows, D normalised dim, T tokens, E experts, K experts per token, B rows, V vocabulary.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from moerl.bench import options
from moerl.bench.common import Row, device_description, format_table, measure_copy_bandwidth, time_fn
from moerl.kernels.norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from moerl.kernels.router import router_topk, router_topk_reference
from moerl.rollout.sampling import SamplingBatch, SamplingParams, gumbel_argmax, gumbel_argmax_reference

EPS = 1e-6
GROUPS = options.KERNEL_GROUPS
Outputs = tuple[torch.Tensor, ...]


def norm_bytes(rows: int, dim: int, itemsize: int, weight_itemsize: int, *, add: bool, train: bool) -> int:
    """Bytes an RMSNorm (add: residual add + RMSNorm) of [rows, dim] must move. Forward: read x (and delta), write
    y (and the sum); the weight read. Training adds the backward: read dy (and the sum's gradient), x (the sum),
    write dx (one gradient: h and delta get the same), read the weight and write dw."""
    n = rows * dim * itemsize
    forward = (4 if add else 2) * n + dim * weight_itemsize
    if not train:
        return forward
    return forward + (4 if add else 3) * n + 2 * dim * weight_itemsize


def router_bytes(tokens: int, experts: int, top_k: int, itemsize: int) -> int:
    """Read the [T, E] logits; write the [T, K] int64 indices and the [T, K] weights in the logits' dtype."""
    return tokens * experts * itemsize + tokens * top_k * (8 + itemsize)


def sampler_bytes(rows: int, vocab: int, itemsize: int) -> int:
    """Read the [B, V] logits and each row's temperature, seed and position; write its token and log-prob."""
    return rows * vocab * itemsize + rows * (4 + 8 + 8) + rows * (8 + 4)


@dataclass
class Case:
    name: str
    group: str
    ours: Callable[..., object]
    reference: Callable[..., object]
    step: Callable[[Callable[..., object]], Callable[[], Outputs]]  # step(fn): one call of fn on the case's inputs
    nbytes: int


@dataclass
class Result:
    name: str
    nbytes: int
    ours_s: float
    torch_s: float
    compiled_s: float | None  # None: not run (CPU, --no-compile) or it failed (see note)
    equal: float
    compiled_equal: float | None = None
    note: str = ""


def _outputs(out: object) -> Outputs:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)  # type: ignore[arg-type]


def _norm_case(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, add: bool,
               train: bool, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    D = shape[-1]
    draw = lambda scale=1.0: (scale * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)  # noqa: E731
    h, delta, dy, dsum = draw(2.0), draw(), draw(), draw()
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(device=device, dtype=dtype)
    if train:
        h, delta, w = (t.requires_grad_() for t in (h, delta, w))

    def step(fn: Callable[..., object]) -> Callable[[], Outputs]:
        def call() -> Outputs:
            if not add:
                y = fn(h, w, EPS)
                return (y, *torch.autograd.grad(y, (h, w), dy)) if train else (y,)
            outs = _outputs(fn(h, delta, w, EPS))
            return (*outs, *torch.autograd.grad(outs, (h, delta, w), (dsum, dy))) if train else outs
        return call

    rows = h.numel() // D
    return Case(name, "train" if train else "decode", add_rms_norm if add else rms_norm,
                add_rms_norm_reference if add else rms_norm_reference, step,
                norm_bytes(rows, D, h.element_size(), w.element_size(), add=add, train=train))


def _router_case(name: str, T: int, E: int, K: int, dtype: torch.dtype, device: torch.device) -> Case:
    gen = torch.Generator().manual_seed(23)
    logits_TE = torch.randn(T, E, generator=gen).to(device=device, dtype=dtype)
    step = lambda fn: lambda: _outputs(fn(logits_TE, K, True))  # noqa: E731
    return Case(name, "decode", router_topk, router_topk_reference, step,
                router_bytes(T, E, K, logits_TE.element_size()))


def _sampler_case(name: str, B: int, V: int, dtype: torch.dtype, device: torch.device) -> Case:
    """One decode step's sampling: temperatures 1, 1, 0 (greedy) and 0.6 by turns, every row its own seed."""
    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=[1.0, 1.0, 0.0, 0.6][i % 4], seed=10_000 + i) for i in range(B)]
    batch = SamplingBatch.empty(B, device)
    batch.set_rows(list(range(B)), params, [p.seed for p in params], [128 + i for i in range(B)])
    logits_BV = (2 * torch.randn(B, V, generator=gen)).to(device=device, dtype=dtype)
    step = lambda fn: lambda: _outputs(fn(logits_BV, batch))  # noqa: E731
    return Case(name, "sampler", gumbel_argmax, gumbel_argmax_reference, step,
                sampler_bytes(B, V, logits_BV.element_size()))


def cases(device: torch.device, groups: tuple[str, ...]) -> list[Case]:
    """The decode step's shapes (256 rows, 30B-A3B's hidden 2048, q_norm over 32 heads of 128, 128 experts top-8,
    Qwen3's vocabulary) and the trainer's (a 32k-token micro-batch at the 1.65B preset's hidden 1024, 16 heads of
    64); on a CPU the same cases, tiny."""
    gpu = device.type == "cuda"
    R, D, H, d, E, V = (256, 2048, 32, 128, 128, 151_936) if gpu else (7, 64, 4, 16, 16, 2000)
    T_train, D_train, H_train, d_train = (32_768, 1024, 16, 64) if gpu else (64, 64, 4, 16)
    dtype = torch.bfloat16 if gpu else torch.float32
    out: list[Case] = []
    if "decode" in groups:
        out += [_norm_case(f"add+rms_norm {R}x{D}", (R, D), dtype, device, add=True, train=False, seed=21),
                _norm_case(f"q_norm {R}x{H}x{d}", (R, H, d), dtype, device, add=False, train=False, seed=22),
                _router_case(f"router top-8 of {E}, T={R}", R, E, 8, dtype, device)]
    if "train" in groups:
        out += [_norm_case(f"input norm {T_train}x{D_train} fwd+bwd", (T_train, D_train), dtype, device, add=False,
                           train=True, seed=31),
                _norm_case(f"add + post norm {T_train}x{D_train} fwd+bwd", (T_train, D_train), dtype, device,
                           add=True, train=True, seed=32),
                _norm_case(f"q_norm {T_train}x{H_train}x{d_train} fwd+bwd", (T_train, H_train, d_train), dtype,
                           device, add=False, train=True, seed=33)]
    if "sampler" in groups:
        out += [_sampler_case(f"sampler {R}x{V} {str(t).removeprefix('torch.')}", R, V, t, device)
                for t in ((torch.float32, torch.bfloat16) if gpu else (torch.float32,))]
    return out


def graph_seconds(call: Callable[[], object], calls: int, reps: int) -> float:
    """Seconds per call of `call` captured `calls` times in one CUDA graph, over `reps` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture: Triton compiles, one-time checks, cuBLAS handles
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (calls * reps)


def equal_fraction(got: Outputs, want: Outputs) -> float:
    """Elements of `got` bitwise equal to `want`'s (NaN equals nothing), over every output."""
    same = sum(int((g == w).sum()) for g, w in zip(got, want, strict=True))
    return same / max(sum(g.numel() for g in got), 1)


def measure(case: Case, device: torch.device, args: argparse.Namespace, compile_peer: bool) -> Result:
    graph = device.type == "cuda" and case.group != "train"

    def seconds(fn: Callable[..., object]) -> float:
        call = case.step(fn)
        with torch.set_grad_enabled(case.group == "train"):
            if graph:
                return graph_seconds(call, args.calls, args.reps)
            return time_fn(call, device, warmup=2, iters=args.reps)

    def outputs(fn: Callable[..., object]) -> Outputs:
        with torch.set_grad_enabled(case.group == "train"):
            return case.step(fn)()

    want = outputs(case.reference)
    result = Result(case.name, case.nbytes, seconds(case.ours), seconds(case.reference), None,
                    equal_fraction(outputs(case.ours), want))
    if not compile_peer:
        return result
    try:
        compiled = torch.compile(case.reference, fullgraph=True, dynamic=False)
        result.compiled_equal = equal_fraction(outputs(compiled), want)  # compiles it, outside any graph capture
        result.compiled_s = seconds(compiled)
    except Exception as e:  # noqa: BLE001 - a peer's failure: say why, keep our numbers
        result.note = f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return result


def rows(results: list[Result], copy_bw: float, peer: str) -> list[Row]:
    """One row a case: GB/s of the bytes it must move, ours against the peer (`torch` or `compile`), and our
    fraction of the copy bandwidth."""
    out = []
    for r in results:
        peer_s = r.torch_s if peer == "torch" else r.compiled_s
        if peer_s is not None:
            out.append(Row(r.name, r.nbytes / r.ours_s / 1e9, r.nbytes / peer_s / 1e9, "GB/s", ceiling=copy_bw / 1e9))
    return out


def _parse(argv: list[str]) -> argparse.Namespace:
    return options.parser("kernels").parse_args(argv)  # moerl/bench/options.py: --help before torch loads


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(argv or []))
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    groups = GROUPS if args.group == "all" else (args.group,)
    print(f"kernels on {device_description(device)}: {', '.join(groups)}"
          + ("" if device.type == "cuda" else " (CPU: tiny shapes, ours is the torch reference)"), flush=True)
    copy_bw = measure_copy_bandwidth(device)
    results = []
    print(f"{'case':<40} {'ours us':>9} {'torch us':>9} {'compile us':>11} {'floor us':>9} {'equal':>8} "
          f"{'compile equal':>13}")
    for case in cases(device, groups):
        r = measure(case, device, args, compile_peer=device.type == "cuda" and not args.no_compile)
        results.append(r)
        compiled = f"{r.compiled_s * 1e6:>11,.1f}" if r.compiled_s is not None else f"{'-':>11}"
        compiled_eq = f"{r.compiled_equal:>13.5f}" if r.compiled_equal is not None else f"{'-':>13}"
        print(f"{r.name:<40} {r.ours_s * 1e6:>9,.1f} {r.torch_s * 1e6:>9,.1f} {compiled} "
              f"{r.nbytes / copy_bw * 1e6:>9,.1f} {r.equal:>8.5f} {compiled_eq}" + (f"  {r.note}" if r.note else ""),
              flush=True)
    print(f"hw limit: the bytes each case must move at the measured copy bandwidth {copy_bw / 1e9:,.0f} GB/s "
          "(the floor column)")
    print()
    print(format_table("kernels: ours vs the torch expressions they replace (GB/s of the bytes each must move)",
                       rows(results, copy_bw, "torch"), peer_name="torch"))
    compiled_rows = rows(results, copy_bw, "compile")
    if compiled_rows:
        print()
        print(format_table("kernels: ours vs torch.compile of the same expressions", compiled_rows,
                           peer_name="torch.compile"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
