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

    def fill(self, reqs: list, table_RW: torch.Tensor, staging: HostStaging) -> None:
        """Write reqs' inputs into these (static) tensors in place; row = the request's table row, and rows
        without a decoding request keep block table zeros, so they write to the null block. Host work here
        delays every decode step, so the per-row ints travel in one staged host-to-device copy, and a row's
        sampling settings are written only when another request took the row."""
        width = max(len(r.blocks) for r in reqs)  # live blocks of the longest row: copy no more
        staged = staging.take(len(reqs), 3 + width)
        host = staged.numpy()
        host[:, 0] = slots = [r.slot for r in reqs]
        host[:, 1] = [r.tokens[-1] for r in reqs]
        host[:, 2] = [r.num_computed for r in reqs]
        host[:, 3:] = table_RW.numpy()[slots, :width]
        rows_BC = staged.to(self.ids_B.device, non_blocking=True)  # staging is reused only after the step's sync
        rows = rows_BC[:, 0]
        self.ids_B.zero_()
        self.pos_B.zero_()
        self.table_BW.zero_()
        self.ids_B[rows] = rows_BC[:, 1]
        self.pos_B[rows] = rows_BC[:, 2]
        self.table_BW[rows, :width] = rows_BC[:, 3:]
        self.sampling.position_B[rows] = rows_BC[:, 2] + 1  # decoding: len(tokens) = num_computed + 1
        new = [r for r in reqs if self.owners[r.slot] is not r]
        if new:
            self.sampling.set_rows([r.slot for r in new], [r.params for r in new], [r.seed for r in new],
                                   [len(r.tokens) for r in new])
            for r in new:
                self.owners[r.slot] = r


class HostStaging:
    """A reused host int64 buffer for decode inputs: pinned on CUDA (so the copy is asynchronous)."""

    def __init__(self, device: torch.device, min_numel: int) -> None:
        self.pin, self.min_numel = device.type == "cuda", min_numel
        self.buf: torch.Tensor | None = None

    def take(self, rows: int, cols: int) -> torch.Tensor:
        need = rows * cols
        if self.buf is None or self.buf.numel() < need:
            self.buf = torch.empty(max(need, self.min_numel), dtype=torch.long, pin_memory=self.pin)
        return self.buf[:need].view(rows, cols)


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
