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

from moerl.rollout.sampling import SamplingBatch


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
        rows_BC = staging.upload(staged, self.ids_B.device)
        rows = rows_BC[:, 0]
        self.ids_B.zero_()
        self.pos_B.zero_()
        self.table_BW.zero_()
        self.ids_B[rows] = rows_BC[:, 1]
        self.pos_B[rows] = rows_BC[:, 2]
        self.table_BW[rows, :width] = rows_BC[:, 3:]
        self.sampling.position_B[rows] = rows_BC[:, 2] + 1  # decoding: len(tokens) = num_computed + 1
        self._own(reqs, [len(r.tokens) for r in reqs])

    def fill_next(self, plan, table_RW: torch.Tensor, staging: HostStaging) -> None:
        """Write the inputs of a planned step (decode_pipeline.DecodePlan) whose tokens may still be on the device:
        a row's input id is the token its request sampled in `plan.prev`, read there by table row (a joiner's
        comes from the host). A row whose token was one of its stop tokens (and past min_new_tokens) finished:
        it becomes a padding row (id 0, position 0, the null block), exactly the row the host would have
        written had it read the token first, so the step computes what a step filled after the read computes."""
        width = plan.width
        num_stops = max(1, max(len(r.params.stop_token_ids) for r in plan.rows))
        staged = staging.take(len(plan.rows), 4 + width + num_stops)
        host = staged.numpy()
        host[:, 0] = plan.slots
        host[:, 1] = plan.pos
        host[:, 2] = plan.stoppable
        host[:, 3] = plan.host_token
        host[:, 4: 4 + width] = table_RW.numpy()[plan.slots, :width]
        host[:, 4 + width:] = [r.params.stop_token_ids + (-1,) * (num_stops - len(r.params.stop_token_ids))
                               for r in plan.rows]
        rows_RC = staging.upload(staged, self.ids_B.device)
        slot_R, pos_R, table_RW_dev = rows_RC[:, 0], rows_RC[:, 1], rows_RC[:, 4: 4 + width]
        prev_B = plan.prev.token_B  # a joiner's slot may lie past it: clamped, then its host id is taken
        token_R = torch.where(rows_RC[:, 3] >= 0, rows_RC[:, 3], prev_B[slot_R.clamp(max=prev_B.shape[0] - 1)])
        stopped_R = (rows_RC[:, 2] != 0) & (token_R[:, None] == rows_RC[:, 4 + width:]).any(dim=1)
        keep_R = (~stopped_R).long()
        self.ids_B.zero_()
        self.pos_B.zero_()
        self.table_BW.zero_()
        self.ids_B[slot_R] = token_R * keep_R
        self.pos_B[slot_R] = pos_R * keep_R
        self.table_BW[slot_R, :width] = table_RW_dev * keep_R[:, None]
        self.sampling.position_B[slot_R] = pos_R + 1
        self._own(plan.rows, [p + 1 for p in plan.pos], plan.slots)

    def _own(self, reqs: list, positions: list[int], slots: list[int] | None = None) -> None:
        """Write the sampling settings of the rows another request held before (one copy per field)."""
        slots = [r.slot for r in reqs] if slots is None else slots
        new = [i for i, (r, s) in enumerate(zip(reqs, slots)) if self.owners[s] is not r]
        if new:
            self.sampling.set_rows([slots[i] for i in new], [reqs[i].params for i in new],
                                   [reqs[i].seed for i in new], [positions[i] for i in new])
            for i in new:
                self.owners[slots[i]] = reqs[i]


class HostStaging:
    """Host int64 buffers for decode inputs: pinned on CUDA, so the copy is asynchronous. Two of them, used in
    turn, each handed out again only once the device has copied it (an event recorded after its copy): with
    overlapped decode the next step's inputs are written while the previous step's copy may still be queued."""

    def __init__(self, device: torch.device, min_numel: int) -> None:
        self.pin, self.min_numel = device.type == "cuda", min_numel
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.events: list = [None, None]
        self.turn = 0

    def take(self, rows: int, cols: int) -> torch.Tensor:
        self.turn ^= 1
        need, buf = rows * cols, self.bufs[self.turn]
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()  # its last copy has left it
        if buf is None or buf.numel() < need:
            buf = self.bufs[self.turn] = torch.empty(max(need, self.min_numel), dtype=torch.long,
                                                     pin_memory=self.pin)
        return buf[:need].view(rows, cols)

    def upload(self, staged: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The staged rows on the device (on the CPU, the buffer itself: it is read before the next take)."""
        out = staged.to(device, non_blocking=True)
        if self.pin:
            event = self.events[self.turn] = self.events[self.turn] or torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return out


# decode(batch, kv_len, hints) -> (token_B, logprob_B, routing_BLK): what is captured.
DecodeFn = Callable[..., tuple]


class DecodeGraphs:
    """Captures `decode` once per (bucket, sampling variant); `prepare` returns the graph with its static input
    batch and outputs, or None when capture failed (the caller then decodes eagerly). The caller fills the
    batch (DecodeBatch.fill or fill_next) and replays."""

    def __init__(self, max_batch_size: int, width: int, kv_len: int, device: torch.device,
                 decode: DecodeFn) -> None:
        self.width, self.kv_len, self.device = width, kv_len, device
        self.decode = decode
        self.buckets = []
        b = 1
        while b < max_batch_size:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(max_batch_size)
        self.captured: dict[tuple, tuple] = {}
        self.pool = None
        self.disabled_reason: str | None = None

    def prepare(self, n: int, hints: dict):
        """(graph, batch, outputs) of the smallest bucket holding n rows, captured on first use; or None."""
        bucket = next(b for b in self.buckets if b >= n)
        # One graph per (bucket, sampling variant): greedy-only batches skip the noise, unfiltered ones the sort,
        # top-k batches sort only their top_k_cap candidates.
        key = (bucket, *sorted(hints.items()))
        if self.disabled_reason is None and key not in self.captured:
            try:
                self.captured[key] = self._capture(bucket, hints)
            except RuntimeError as e:  # fall back to eager rather than fail the rollout
                self.disabled_reason = str(e).splitlines()[0]
                warnings.warn(f"CUDA graph capture failed, decoding eagerly: {self.disabled_reason}")
        if self.disabled_reason is not None:
            return None
        return self.captured[key]

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
