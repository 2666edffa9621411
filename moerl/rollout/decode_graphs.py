"""Decode as CUDA graphs: one captured forward+sampling per batch-size bucket (1, 2, 4, ... rows).

A decode step is dozens of small kernels per layer; replaying a graph removes their launch gaps. Static
shapes make this possible: the batch is padded to its bucket (padding rows write to the null block), the block
table has a fixed width (the blocks of one full-length request), the paged attention kernel reads each row's
live positions only (its loop bounds are device tensors), and MoE routing never leaves the device.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from moerl.rollout.sampling import SamplingBatch, sampling_hints


@dataclass
class DecodeBatch:
    """The inputs of one decode forward; static buffers when it runs in a CUDA graph."""

    ids_B: torch.Tensor  # int64 the token fed at each row (row = the request's table row)
    pos_B: torch.Tensor  # int64 its position
    table_BW: torch.Tensor  # int64 the row's blocks; 0 (the null block) for padding
    sampling: SamplingBatch
    owners: list = field(default_factory=list)  # the request whose sampling settings each row holds (host)

    @classmethod
    def empty(cls, n: int, width: int, device: torch.device | str) -> DecodeBatch:
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        return cls(zeros(n), zeros(n), zeros(n, width), SamplingBatch.empty(n, device), [None] * n)


# fill(reqs, n, batch): write the batch's inputs into the static tensors in place.
FillInputs = Callable[[list, int, DecodeBatch], None]
# decode(batch, kv_len, hints) -> (token_B, logprob_B, routing_BLK): what is captured.
DecodeFn = Callable[..., tuple]


class DecodeGraphs:
    """Captures `decode` once per (bucket, sampling variant) and replays it; `run` returns None when capture
    failed (the caller then decodes eagerly)."""

    def __init__(self, max_batch_size: int, width: int, kv_len: int, device: torch.device,
                 fill_inputs: FillInputs, decode: DecodeFn) -> None:
        self.width, self.kv_len, self.device = width, kv_len, device
        self.fill_inputs, self.decode = fill_inputs, decode
        self.buckets = []
        b = 1
        while b < max_batch_size:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(max_batch_size)
        self.captured: dict[tuple, tuple] = {}
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
        graph, batch, outs = self.captured[key]
        self.fill_inputs(reqs, bucket, batch)
        graph.replay()
        return outs

    def _capture(self, n: int, hints: dict):
        batch = DecodeBatch.empty(n, self.width, self.device)
        run = lambda: self.decode(batch, self.kv_len, hints)  # noqa: E731
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
        return graph, batch, outs
