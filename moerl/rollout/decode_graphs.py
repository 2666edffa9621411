"""Decode as CUDA graphs: one captured forward+sampling per batch-size bucket (1, 2, 4, ... slots).

A decode step is dozens of small kernels per layer; replaying a graph removes their launch gaps. Static
shapes make this possible: the batch is padded to its bucket (padding rows write to the cache's scratch
column), attention spans the whole slab with a mask, and MoE routing never leaves the device.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from moerl.rollout.kv_cache import SlabKVCache
from moerl.rollout.sampling import SamplingBatch, sampling_hints

# fill(reqs, n, ids_B, pos_B, write_B, sampling): write the batch's inputs into the static tensors in place.
FillInputs = Callable[[list, int, torch.Tensor, torch.Tensor, torch.Tensor, SamplingBatch], None]
# decode(ids_B, pos_B, write_B, sampling, kv_len, hints) -> (token_B, logprob_B, routing_BLK): what is captured.
DecodeFn = Callable[..., tuple]


class DecodeGraphs:
    """Captures `decode` once per (bucket, sampling variant) and replays it; `run` returns None when capture
    failed (the caller then decodes eagerly)."""

    def __init__(self, cache: SlabKVCache, max_batch_size: int, fill_inputs: FillInputs, decode: DecodeFn) -> None:
        self.cache, self.fill_inputs, self.decode = cache, fill_inputs, decode
        self.kv_len = cache.max_seq_len + 1
        self.buckets = []
        b = 1
        while b < max_batch_size:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(max_batch_size)
        self.captured: dict[int, tuple] = {}
        self.pool = None
        self.disabled_reason: str | None = None

    def run(self, reqs, n: int):
        bucket = next(b for b in self.buckets if b >= n)
        # One graph per (bucket, sampling variant): greedy-only batches skip the noise, unfiltered ones the sort,
        # top-k batches sort only their top_k_cap candidates.
        hints = sampling_hints(reqs)
        key = (bucket, *sorted(hints.items()))
        if self.disabled_reason is None and key not in self.captured:
            try:
                self.captured[key] = self._capture(bucket, hints)
            except RuntimeError as e:  # fall back to eager rather than fail the rollout
                self.disabled_reason = str(e).splitlines()[0]
                warnings.warn(f"CUDA graph capture failed, decoding eagerly: {self.disabled_reason}")
        if self.disabled_reason is not None:
            return None
        graph, ids, pos, write, sampling, outs = self.captured[key]
        self.fill_inputs(reqs, bucket, ids, pos, write, sampling)
        graph.replay()
        return outs

    def _capture(self, n: int, hints: dict):
        dev = self.cache.k[0].device
        ids, pos = torch.zeros(n, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev)
        write = torch.full((n,), self.cache.scratch_column, dtype=torch.long, device=dev)
        sampling = SamplingBatch.empty(n, dev)
        run = lambda: self.decode(ids, pos, write, sampling, self.kv_len, hints)  # noqa: E731
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
