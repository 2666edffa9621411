"""Shared pieces of the benchmarks: timing, hardware ceilings measured in the same run, the result table.

Benchmarks import only torch (and the peer they measure), so `python -m moerl.cli bench ...` runs on a GPU
host that has nothing of ours installed but this source tree.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, iters: int = 10) -> float:
    """Median seconds per call. CUDA: events around each call; CPU: perf_counter."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """FLOP/s of a large square matmul on random data: the practical ceiling for GEMM-bound code."""
    if device.type != "cuda":
        n = 1024
        dtype = torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = time_fn(lambda: a @ b, device, warmup=3, iters=10)
    return 2 * n**3 / seconds


def measure_copy_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    if device.type != "cuda":
        nbytes = 256 << 20
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device, warmup=3, iters=10)
    return 2 * nbytes / seconds


# A timed MoE block at decode sizes cycles through copies of its weights with this many bytes touched in all, so
# none is still in L2 (50 MB on an H100/H200) when its turn comes: a decode step runs every layer once.
L2_DEFEAT_BYTES = 256 << 20


def weight_copies(E: int, D: int, I: int, K: int, element_size: int) -> int:
    """Layers of distinct weights so that what T=1 touches (K experts) over all of them exceeds L2 five times."""
    return max(2, min(32, math.ceil(L2_DEFEAT_BYTES / (min(K, E) * 3 * D * I * element_size))))


@dataclass
class Row:
    metric: str
    ours: float
    peer: float | None = None
    unit: str = ""
    ceiling: float | None = None  # the hardware limit for `ours`, same unit: fraction = ours / ceiling
    higher_is_better: bool = True


def format_table(title: str, rows: list[Row], peer_name: str = "peer") -> str:
    header = ["metric", "moerl", peer_name, "ratio", "of hw limit"]
    lines = []
    for r in rows:
        ratio = ""
        finite = r.peer is not None and math.isfinite(r.peer) and math.isfinite(r.ours)
        if finite and r.peer > 0 and r.ours > 0:
            ratio = f"{(r.ours / r.peer) if r.higher_is_better else (r.peer / r.ours):.2f}x"
        frac = f"{100 * r.ours / r.ceiling:.1f}%" if r.ceiling else ""
        value = lambda v: f"{v:,.4g} {r.unit}" if math.isfinite(v) else "-"  # noqa: E731 - inf/nan: none measured
        lines.append([r.metric, value(r.ours), value(r.peer) if r.peer is not None else "-", ratio, frac])
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [title, fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*l) for l in lines]
    return "\n".join(out)


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    import platform

    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads, torch {torch.__version__}"


# Dense bf16 tensor-core peaks from NVIDIA's datasheets (the "with sparsity" figures halved), TFLOP/s. Matched on
# the device name, most specific first: an H100 NVL or PCIe is not an SXM part.
DATASHEET_BF16_TFLOPS: tuple[tuple[str, float, str], ...] = (
    ("H200", 989.5, "NVIDIA H200 Tensor Core GPU datasheet, SXM: 1,979 TFLOP/s bf16 with sparsity"),
    ("H100 NVL", 835.5, "NVIDIA H100 datasheet, NVL: 1,671 TFLOP/s bf16 with sparsity"),
    ("H100 PCIe", 756.5, "NVIDIA H100 datasheet, PCIe: 1,513 TFLOP/s bf16 with sparsity"),
    ("H100", 989.5, "NVIDIA H100 datasheet, SXM: 1,979 TFLOP/s bf16 with sparsity"),
    ("A100", 312.0, "NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense"),
)


def datasheet_bf16_peak(device: torch.device) -> tuple[float, str] | None:
    """(dense bf16 FLOP/s, its source) for a GPU in the table above, else None (a CPU, an unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next(((tflops * 1e12, source) for key, tflops, source in DATASHEET_BF16_TFLOPS if key in name), None)


def mfu_line(label: str, flops_per_s: float, measured_peak: float, datasheet: tuple[float, str] | None) -> str:
    """MFU against the datasheet peak (named, with its source) and against the measured matmul peak, one line."""
    measured = f"{100 * flops_per_s / measured_peak:.1f}% of the measured matmul peak {measured_peak / 1e12:.0f} TFLOP/s"
    if datasheet is None:
        return f"{label} MFU: {measured}; no datasheet peak for this device"
    peak, source = datasheet
    return (f"{label} MFU: {100 * flops_per_s / peak:.1f}% of the datasheet bf16 peak {peak / 1e12:.0f} TFLOP/s "
            f"({source}); {measured}")
