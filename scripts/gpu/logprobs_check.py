"""Time moerl.model.logprobs.chunked_token_logprobs on CUDA: peak extra memory and time of forward+backward
against the naive full-logits computation.

    python scripts/gpu/logprobs_check.py              # on a CUDA host, from the repo root
    python scripts/gpu/logprobs_check.py --cpu-smoke  # tiny sizes on CPU: exercises the code paths only

Shape legend: N tokens, D hidden size, V vocabulary.
Prints a table (version, peak extra GB, ms). The accuracy checks against float64 and the chunked version's 2 GB
bound on extra memory are tests/gpu/test_logprobs_gpu.py (`make test-gpu`).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a source tree, moerl not installed

import torch

from moerl.model.logprobs import chunked_token_logprobs
from moerl.model.logprobs import token_logprobs_reference as naive  # what the trainer did before


def inputs(N: int, D: int, V: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden_ND = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight_VD = torch.randn(V, D, generator=g, dtype=torch.float64) * (3 / D**0.5)  # logits ~ N(0, 9): peaky
    target_N = torch.randint(0, V, (N,), generator=g)
    g_logp_N, g_ent_N = torch.randn(2, N, generator=g, dtype=torch.float64)
    return [t.to(device) for t in (hidden_ND, weight_VD, target_N, g_logp_N, g_ent_N)]


def fwd_bwd(fn: Callable, hidden_ND, weight_VD, target_N, g_logp_N, g_ent_N, with_entropy: bool,
            **kw) -> list[torch.Tensor]:
    hidden_ND.grad = weight_VD.grad = None
    logp_N, ent_N = fn(hidden_ND, weight_VD, target_N, with_entropy, **kw)
    loss = (logp_N * g_logp_N.to(logp_N.dtype)).sum()
    if with_entropy:
        loss = loss + (ent_N * g_ent_N.to(ent_N.dtype)).sum()
    loss.backward()
    return [logp_N.detach(), *([ent_N.detach()] if with_entropy else []), hidden_ND.grad, weight_VD.grad]


def chunked(hidden_ND, weight_VD, target_N, with_entropy, **kw):
    return chunked_token_logprobs(hidden_ND, weight_VD, target_N, with_entropy=with_entropy, **kw)


def measure(step: Callable[[], None], device: str, reps: int) -> tuple[float, float] | None:
    """(peak extra GB, median ms) of step(), or None on OOM."""
    cuda = device == "cuda"
    try:
        step()  # warm-up (cuBLAS handles, allocator)
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        step()
        peak_gb = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else float("nan")
        times = []
        for _ in range(reps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
        return peak_gb, statistics.median(times)
    except torch.OutOfMemoryError:
        return None


def benchmark(device: str, N: int, D: int, V: int, reps: int) -> None:
    h64, w64, target_N, g_logp_N, g_ent_N = inputs(N, D, V, device)
    h, w = (t.to(torch.bfloat16).requires_grad_(True) for t in (h64, w64))
    del h64, w64
    g_logp_N, g_ent_N = g_logp_N.float(), g_ent_N.float()
    versions: list[tuple[str, Callable, bool, dict]] = [
        ("chunked (default chunk)", chunked, False, {}),
        ("chunked + entropy", chunked, True, {}),
        ("chunked, chunk_tokens=2048", chunked, False, {"chunk_tokens": 2048}),
        ("naive", naive, False, {}),
        ("naive + entropy", naive, True, {}),
    ]
    print(f"\nforward+backward, bf16, N={N} D={D} V={V} ({device}; peak extra memory includes the grads)")
    print(f"{'version':28s} {'peak extra GB':>14s} {'ms':>9s}")
    for name, fn, ent, kw in versions:
        def step(fn=fn, ent=ent, kw=kw) -> None:
            fwd_bwd(fn, h, w, target_N, g_logp_N, g_ent_N, ent, **kw)
            h.grad = w.grad = None
        result = measure(step, device, reps)
        h.grad = w.grad = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        if result is None:
            print(f"{name:28s} {'OOM':>14s} {'-':>9s}")
            continue
        peak_gb, ms = result
        print(f"{name:28s} {peak_gb:14.2f} {ms:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (no GPU needed)")
    args = parser.parse_args()
    if args.cpu_smoke:
        device, bench_sizes, reps = "cpu", (256, 64, 2000), 2
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --cpu-smoke for a CPU-only smoke test")
        device, bench_sizes, reps = "cuda", (32_768, 1024, 151_936), 5
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    benchmark(device, *bench_sizes, reps=reps)


if __name__ == "__main__":
    main()
