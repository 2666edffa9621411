"""Decode as CUDA graphs: one captured forward+sampling per batch-size bucket (1, 2, 4, ... slots).

A decode step is dozens of small kernels per layer; replaying a graph removes their launch gaps. Static
shapes make this possible: the batch is padded to its bucket (padding rows write to the cache's scratch
column), attention spans the whole slab with a mask, and MoE routing never leaves the device.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from moerl.rollout.sampling import SamplingBatch, sampling_hints

if TYPE_CHECKING:
    from moerl.rollout.engine import Engine


class DecodeGraphs:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kv_len = engine.cache.max_seq_len + 1
        self.buckets = []
        b = 1
        while b < engine.config.max_batch_size:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(engine.config.max_batch_size)
        self.captured: dict[int, tuple] = {}
        self.pool = None
        self.disabled_reason: str | None = None

    def run(self, reqs, n: int):
        bucket = next(b for b in self.buckets if b >= n)
        # One graph per (bucket, sampling variant): greedy-only batches skip the noise, unfiltered ones the sort.
        hints = sampling_hints(reqs)
        key = (bucket, hints["all_greedy"], hints["any_filter"])
        if self.disabled_reason is None and key not in self.captured:
            try:
                self.captured[key] = self._capture(bucket, hints)
            except RuntimeError as e:  # fall back to eager rather than fail the rollout
                self.disabled_reason = str(e).splitlines()[0]
                warnings.warn(f"CUDA graph capture failed, decoding eagerly: {self.disabled_reason}")
        if self.disabled_reason is not None:
            return self.engine._decode_eager(reqs, n)
        graph, ids, pos, write, sampling, outs = self.captured[key]
        self.engine.decode_inputs(reqs, bucket, ids, pos, write, sampling)
        graph.replay()
        return outs

    def _capture(self, n: int, hints: dict):
        dev = self.engine.device
        ids, pos = torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev)
        write = torch.full((n,), self.engine.cache.scratch_column, dtype=torch.long, device=dev)
        sampling = SamplingBatch.empty(n, dev)
        run = lambda: self.engine.decode_forward(ids, pos, write, sampling, self.kv_len, hints)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (Triton compiles, cuBLAS handles) outside the capture
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outs = run()
        self.pool = graph.pool()
        return graph, ids, pos, write, sampling, outs
