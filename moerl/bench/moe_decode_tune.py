"""`moerl bench moe-decode --tune`: a compact sweep of the fused MoE kernels' block configs per (shape, M bucket),
printed as the literal of moerl/kernels/fused_moe_configs.py's `_CONFIGS`.

Per bucket (one representative T) and row-block size BLOCK_M, stage 1 times each kernel's tiles (BLOCK_N x
BLOCK_K) at 4 warps and 3 stages; the BLOCK_M with the least gate_up + down time wins (one alignment serves
both kernels); stage 2 varies warps, stages and row-block grouping around each kernel's best tile. At most 32
configs per bucket and kernel. A binary is keyed by its constexprs (the tile, warps, stages), which buckets and
shapes share, so there are ~100 compiles in all; they, not the timings, dominate. Each config is timed alone in a CUDA graph over L copies of the weights (HBM,
not L2, as in decode); a config that fails to compile or launch is skipped.
"""

from __future__ import annotations

import time

import torch

from moerl.bench.common import time_fn, weight_copies
from moerl.kernels.fused_moe_configs import (M_BUCKETS, SHARED_MEMORY_BYTES, KernelConfig, fused_moe_configs,
                                             m_bucket, shared_memory)

BUCKET_TOKENS = {"1": 1, "2-16": 16, "17-64": 64, "65-256": 256, "257+": 512}
BLOCK_MS = {"1": (16,), "2-16": (16,), "17-64": (16, 32), "65-256": (16, 32, 64), "257+": (32, 64, 128)}
BLOCK_NS = {"gate_up": (32, 64, 128), "down": (64, 128, 256)}  # gate_up loads two weight tiles of BLOCK_N
WEIGHT_TILES = {"gate_up": 2, "down": 1}
WARPS_STAGES = ((4, 3), (4, 2), (4, 4), (4, 5), (8, 3), (8, 4))  # stage 1 runs the first
GROUPS = (1, 8)
KERNELS = ("gate_up", "down")


def fits(cfg: KernelConfig, kernel: str) -> bool:
    return shared_memory(cfg, WEIGHT_TILES[kernel], 2) <= SHARED_MEMORY_BYTES


def tile_candidates(kernel: str, block_m: int) -> list[KernelConfig]:
    """Stage 1's tiles at 4 warps and 3 stages (2 where 3 do not fit); accumulators of at most 8K floats."""
    out = []
    for block_n in BLOCK_NS[kernel]:
        for block_k in (64, 128, 256) if block_m == 16 else (64, 128):
            cfg = KernelConfig(block_m, block_n, block_k, 1, *WARPS_STAGES[0])
            cfg = cfg if fits(cfg, kernel) else cfg._replace(num_stages=2)
            if fits(cfg, kernel) and block_m * block_n <= 8192:
                out.append(cfg)
    return out


class KernelTimer:
    """One shape's L weight copies and inputs; times a kernel config per launch, or None where it fails."""

    def __init__(self, E: int, D: int, I: int, K: int, device: torch.device) -> None:
        self.E, self.D, self.I, self.K, self.device = E, D, I, K, device
        self.L = weight_copies(E, D, I, K, 2)
        gen = torch.Generator(device=device).manual_seed(0)
        draw = lambda *shape: torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen)  # noqa: E731
        self.gate_up = [draw(E, 2 * I, D) * 0.02 for _ in range(self.L)]
        self.down = [draw(E, D, I) * 0.02 for _ in range(self.L)]
        self.draw = draw

    def inputs(self, T: int) -> None:
        from moerl.kernels.triton_fused_moe import moe_align

        # uniform routing without replacement, like a random-init router
        self.idx_TK = torch.topk(torch.rand(T, self.E, device=self.device), self.K, dim=-1).indices
        self.x_TD, self.h_MI = self.draw(T, self.D), self.draw(T * self.K, self.I)
        self.aligned = {bm: moe_align(self.idx_TK, self.E, bm) for bm in (16, 32, 64, 128)}
        self.distinct = torch.unique(self.idx_TK).numel()

    def seconds(self, kernel: str, cfg: KernelConfig) -> float | None:
        from moerl.kernels.triton_fused_moe import down_proj, gate_up_swiglu

        aligned = self.aligned[cfg.block_m]

        def launch(layer: int) -> torch.Tensor:
            if kernel == "gate_up":
                return gate_up_swiglu(self.x_TD, self.gate_up[layer], aligned, self.K, cfg)
            return down_proj(self.h_MI, self.down[layer], aligned, cfg)

        try:
            launch(0)  # compiles
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for layer in range(self.L):
                    launch(layer)
            return time_fn(graph.replay, self.device, warmup=2, iters=5) / self.L
        except Exception as e:  # noqa: BLE001 - a config that does not compile or launch is skipped, not fatal
            first_line = (str(e).splitlines() or [""])[0][:90]
            print(f"    skipped {kernel} {tuple(cfg)}: {type(e).__name__}: {first_line}")
            return None

    def weight_bytes(self, kernel: str) -> int:
        return self.distinct * WEIGHT_TILES[kernel] * self.D * self.I * 2


def best_of(timer: KernelTimer, kernel: str, cfgs: list[KernelConfig]) -> tuple[float, KernelConfig | None]:
    timed = [(s, cfg) for cfg in cfgs if (s := timer.seconds(kernel, cfg)) is not None]
    return min(timed, default=(float("inf"), None))


def tune_bucket(timer: KernelTimer, bucket: str) -> dict[str, tuple[float, KernelConfig | None]]:
    timer.inputs(BUCKET_TOKENS[bucket])
    stage1 = {bm: {k: best_of(timer, k, tile_candidates(k, bm)) for k in KERNELS} for bm in BLOCK_MS[bucket]}
    bm = min(stage1, key=lambda m: stage1[m]["gate_up"][0] + stage1[m]["down"][0])
    result = {}
    for kernel in KERNELS:
        seconds, tile = stage1[bm][kernel]
        if tile is None:
            result[kernel] = (seconds, None)
            continue
        variants = [tile._replace(num_warps=w, num_stages=s, group_m=g) for w, s in WARPS_STAGES for g in GROUPS]
        variants = [v for v in variants if v != tile and fits(v, kernel)]
        result[kernel] = min((seconds, tile), best_of(timer, kernel, variants))
    return result


def tune(shapes: dict[str, tuple[int, int, int]], K: int, device: torch.device) -> None:
    literal = []
    for name, (E, D, I) in shapes.items():
        start = time.perf_counter()
        timer = KernelTimer(E, D, I, K, device)
        print(f"\ntune {name}: E={E} D={D} I={I} top-{K}, {timer.L} weight copies per timed graph")
        print(f"  {'bucket':<7} {'T':>4} {'kernel':<8} {'best (BM, BN, BK, G, warps, stages)':<38} {'us':>8} "
              f"{'GB/s':>7} {'table us':>9}")
        best: dict[str, dict[str, tuple[int, ...]]] = {k: {} for k in KERNELS}
        for bucket in M_BUCKETS:
            T = BUCKET_TOKENS[bucket]
            assert m_bucket(T) == bucket
            result = tune_bucket(timer, bucket)
            shipped = dict(zip(KERNELS, fused_moe_configs(E, D, I, T), strict=True))
            for kernel in KERNELS:
                seconds, cfg = result[kernel]
                if cfg is None:
                    print(f"  {bucket:<7} {T:>4} {kernel:<8} no config ran")
                    best[kernel][bucket] = tuple(shipped[kernel])
                    continue
                now = timer.seconds(kernel, shipped[kernel])
                best[kernel][bucket] = tuple(cfg)
                print(f"  {bucket:<7} {T:>4} {kernel:<8} {str(tuple(cfg)):<38} {seconds * 1e6:>8.1f} "
                      f"{timer.weight_bytes(kernel) / seconds / 1e9:>7.0f} "
                      f"{now * 1e6 if now else float('nan'):>9.1f}")
        print(f"  ({time.perf_counter() - start:.0f} s)")
        literal.append(f"    ({E}, {D}, {I}): {{  # {name}, tuned on {torch.cuda.get_device_name(device)}")
        for kernel in KERNELS:  # the table's layout: three buckets on the first line, two on the second
            entries = [f'"{b}": {best[kernel][b]}' for b in M_BUCKETS]
            literal.append(f'        "{kernel}": {{{", ".join(entries[:3])},')
            literal.append(" " * (len(kernel) + 13) + f'{", ".join(entries[3:])}}},')
        literal.append("    },")
        del timer
        torch.cuda.empty_cache()
    print("\n# moerl/kernels/fused_moe_configs.py _CONFIGS entries (paste over the shapes'):")
    print("\n".join(literal))
