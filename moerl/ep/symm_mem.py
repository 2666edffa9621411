"""Expert parallelism over NVSHMEM symmetric memory: torch.ops.symm_mem.all_to_all_vdev_2d(_offset).

Shape legend: T tokens on this rank, K experts per token, D hidden size, E experts, P ranks, L = E/P
experts per rank, M kept (token, slot) rows sent by this rank, C tokens-per-rank capacity of the buffers,
N = P*C*K rows of x_ND (the worst case: every row of every rank comes here).

    dispatch: sort pairs by global expert (= rank-major, then local expert) -> all_to_all_vdev_2d with
              in_splits = counts_E; the op returns expert-major chunks [local expert][source rank] and
              their splits/offsets on the device -> one gather compacts them into x_ND
    combine:  all_to_all_vdev_2d_offset sends the expert-major chunks back; they land rank-major, i.e.
              in the sorted order of the source -> weighted sum over slots on the source rank

The splits never leave the device: no host sync in the steady state. The price is that x_ND always has
N rows: the first counts_L.sum() rows are the data, the rest are zero padding that combine never reads.
(all_to_all_vdev_2d pads every expert segment to `major_align`, and an empty one to at least one row; the
compaction removes that padding, so x_ND follows the contract: contiguous segments of counts_L rows.)

Limits of the ops (torch 2.8-2.13 nvshmem_extension.cu, THREADS_PER_BLOCK 512, tiles of 32): dispatch
allows P <= 32 and L <= 16, combine P <= 16 and L <= 32, so this backend needs P <= 16 and L <= 16.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moerl.ep.dispatcher import BackendUnavailable, Dispatcher, weighted_sum_over_slots
from moerl.ep.permute import expand_tokens, sort_by_expert

MAX_RANKS = 16  # all_to_all_vdev_2d_offset: world_size <= NUM_TILES (512 / 32)
MAX_LOCAL_EXPERTS = 16  # all_to_all_vdev_2d: experts per rank <= NUM_TILES
OPS = ("all_to_all_vdev_2d", "all_to_all_vdev_2d_offset")


def symm_mem_unavailable_reason(group: dist.ProcessGroup | None = None, num_experts: int | None = None) -> str | None:
    """None when SymmMemDispatcher can run on `group`, else why not. Never raises (safe on CPU-only hosts).

    Sets the symmetric-memory backend to NVSHMEM as a side effect (it must be set before any allocation).
    """
    try:
        return _unavailable_reason(group, num_experts)
    except Exception as e:  # noqa: BLE001 - a probe reports, it does not fail
        return f"the symmetric-memory probe failed: {type(e).__name__}: {e}"


def _unavailable_reason(group, num_experts) -> str | None:
    if not torch.cuda.is_available():
        return f"CUDA is not available (torch {torch.__version__}); symm_mem needs NVIDIA GPUs"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch {torch.__version__} lacks torch.distributed._symmetric_memory ({e})"
    for op in OPS:
        try:
            getattr(torch.ops.symm_mem, op)
        except (AttributeError, RuntimeError):
            return f"torch {torch.__version__} lacks torch.ops.symm_mem.{op}"
    if not getattr(symm_mem, "is_nvshmem_available", lambda: False)():
        return "NVSHMEM is not available (this torch build lacks it, or libnvshmem_host.so.3 is missing)"
    if torch.cuda.get_device_capability() < (7, 0):
        return f"NVSHMEM needs compute capability >= 7.0, this GPU has {torch.cuda.get_device_capability()}"
    try:
        if hasattr(symm_mem, "set_backend"):
            symm_mem.set_backend("NVSHMEM")
        else:  # older torch reads the backend from the environment
            os.environ["TORCH_SYMMMEM"] = "NVSHMEM"
    except Exception as e:  # noqa: BLE001 - fails once another backend has allocated
        if symm_mem.get_backend(torch.device("cuda")) != "NVSHMEM":
            return f"cannot set the symmetric-memory backend to NVSHMEM: {e}"
    if group is not None:
        backend = str(dist.get_backend(group))
        if "nccl" not in backend.lower():
            return f"the expert-parallel group uses backend {backend!r}; symm_mem needs an NCCL group"
        P = dist.get_world_size(group)
        if P < 2:
            # Seen on an H200 with torch 2.11: rendezvous asserts `global_ranks.size() > 1`.
            return "the group has 1 rank; NVSHMEM symmetric-memory rendezvous needs at least 2 ranks (GPUs)"
        if P > MAX_RANKS:
            return f"the group has {P} ranks; all_to_all_vdev_2d_offset allows at most {MAX_RANKS}"
        if num_experts is not None and num_experts % P == 0 and num_experts // P > MAX_LOCAL_EXPERTS:
            return (f"{num_experts // P} experts per rank; all_to_all_vdev_2d allows at most "
                    f"{MAX_LOCAL_EXPERTS} (use more ranks)")
    return None


class _Buffers:
    """Symmetric buffers of one group, shared by every SymmMemDispatcher on it (one per MoE layer).

    Two sets used alternately (op g uses set g % 2). The ops pull from the peers' send buffers and write
    splits into the peers' memory before their opening barrier; alternating means a set is written again
    only after the next op's barrier, which every rank passes only once it has finished with that set.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.name, self.P = group, group.group_name, dist.get_world_size(group)
        self.key, self.cap, self.sets, self.step, self.cpu_group = None, 0, [], 0, None

    def agree_max(self, n: int) -> int:
        """Max of n over the group through a CPU (gloo) group: a host rendezvous, never a device sync."""
        if self.P == 1:
            return n
        if self.cpu_group is None:
            gloo = "gloo" in str(dist.get_backend(self.group)).lower()
            self.cpu_group = self.group if gloo else dist.new_group(
                dist.get_process_group_ranks(self.group), backend="gloo", use_local_synchronization=True)
        t = torch.tensor([n])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return int(t)

    def ensure(self, T: int, max_tokens: int, K: int, D: int, L: int, dtype, device) -> int:
        """Buffers for C >= T tokens per rank; returns this call's capacity C. max_tokens > 0 (the same on
        every rank): C = max_tokens, no per-call communication. Else C = max T over the group, agreed on
        every call, and the buffers grow (on every rank together) when C exceeds them."""
        if max_tokens:
            if T > max_tokens:
                raise ValueError(f"{T} tokens on rank {dist.get_rank(self.group)} exceed max_tokens={max_tokens}")
            if self.key == (K, D, L, dtype) and max_tokens <= self.cap:
                return max_tokens
            C = T = self.agree_max(max_tokens)
        else:
            C = T = self.agree_max(T)
            if self.key == (K, D, L, dtype) and T <= self.cap:
                return C
        import torch.distributed._symmetric_memory as symm_mem

        P, cap = self.P, max(T, 1)
        self.sets = []  # free the old buffers first
        # NVSHMEM reads its heap size once, at its first allocation (default 1 GiB): room for one growth.
        need = 2 * ((P + 1) * cap * K + L + 1) * D * torch.finfo(dtype).bits // 8
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(1 << 30, 2 * need + (64 << 20))))
        with warnings.catch_warnings():  # deprecated (a no-op) in recent torch, needed in older
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(self.name)
        for _ in range(2):
            s = dict(
                small=symm_mem.empty(cap * K, D, dtype=dtype, device=device),  # dispatch send / combine recv
                big=symm_mem.empty(P * cap * K + L + 1, D, dtype=dtype, device=device),  # last row: zeros
                splits=symm_mem.empty(P * L, dtype=torch.int64, device=device),
                in_so=symm_mem.empty(2, P * L, dtype=torch.int64, device=device),
                out_so=symm_mem.empty(2, P * L, dtype=torch.int64, device=device),
            )
            for buf in s.values():
                buf.zero_()
                symm_mem.rendezvous(buf, self.name)
            self.sets.append(s)
        self.key, self.cap, self.zero_row = (K, D, L, dtype), cap, P * cap * K + L
        self.arange_N = torch.arange(P * cap * K, device=device)
        return C

    def next_set(self) -> dict:
        s = self.sets[self.step % 2]
        self.step += 1
        return s

    def dispatch_rows(self, rows_MD: torch.Tensor, route: "_Route") -> torch.Tensor:
        """Send sorted rows to their experts; return them compacted [local expert][source rank], N rows."""
        s = self.next_set()
        s["small"][: rows_MD.shape[0]].copy_(rows_MD)
        s["splits"].copy_(route.counts_E)
        torch.ops.symm_mem.all_to_all_vdev_2d(s["small"], s["big"], s["splits"], s["out_so"], self.name, 1)
        splits, padded_off = s["out_so"][0].clone(), s["out_so"][1].clone()  # [expert][source] chunks
        end = torch.cumsum(splits, 0)
        route.splits, route.compact_off = splits, end - splits
        chunk = torch.searchsorted(end, self.arange_N[: route.N], right=True)  # P*L past the data
        last = chunk.clamp(max=splits.numel() - 1)
        src = self.arange_N[: route.N] - route.compact_off[last] + padded_off[last]
        src = torch.where(chunk < splits.numel(), src, self.zero_row)
        return s["big"].index_select(0, src)

    def combine_rows(self, y_ND: torch.Tensor, route: "_Route") -> torch.Tensor:
        """Send expert-grouped rows back; return the M rows in the source's sorted order."""
        s = self.next_set()
        s["big"][: y_ND.shape[0]].copy_(y_ND)
        s["in_so"][0].copy_(route.splits)
        s["in_so"][1].copy_(route.compact_off)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(s["big"], s["small"], s["in_so"], s["out_so"], self.name)
        return s["small"][: route.num_kept].clone()


@dataclass
class _Route:
    counts_E: torch.Tensor  # rows this rank sends to each global expert
    num_kept: int  # M
    N: int  # rows of x_ND
    splits: torch.Tensor | None = None  # [local expert][source rank] rows received (set by dispatch)
    compact_off: torch.Tensor | None = None  # their offsets in x_ND


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_MD, route, bufs):
        ctx.route, ctx.bufs = route, bufs
        return bufs.dispatch_rows(rows_MD, route)

    @staticmethod
    def backward(ctx, grad_ND):
        return ctx.bufs.combine_rows(grad_ND.contiguous(), ctx.route), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, route, bufs):
        ctx.route, ctx.bufs = route, bufs
        return bufs.combine_rows(y_ND, route)

    @staticmethod
    def backward(ctx, grad_MD):
        return ctx.bufs.dispatch_rows(grad_MD.contiguous(), ctx.route), None, None


@dataclass(frozen=True)
class SymmMemHandle:
    route: _Route
    order_M: torch.Tensor
    num_kept: int
    topk_weights_TK: torch.Tensor


_BUFFERS: dict[dist.ProcessGroup, _Buffers] = {}  # by group object: a re-created group may reuse the name


class SymmMemDispatcher(Dispatcher):
    """Rank r holds experts [r*L, (r+1)*L); rows travel through NVSHMEM symmetric buffers.

    x_ND has N = P*C*K rows for a capacity of C tokens per rank: rows past counts_L.sum() are zero
    padding, and combine never reads the rows of y_ND past counts_L.sum(). The buffers are allocated at the
    first dispatch (a collective: every rank must call it) and grow when C exceeds them:
      - max_tokens > 0, the same on every rank: C = max_tokens. No communication besides the two ops and
        no host sync; T > max_tokens raises. The setting for training (a token budget per micro-batch).
      - max_tokens = 0: every dispatch agrees on C = max T over the group through a CPU (gloo) all_reduce
        (a host rendezvous, never a device sync; skipped on one rank).
    Router weights are applied on the source rank, so their gradient stays local.
    """

    def __init__(self, num_experts: int, group: dist.ProcessGroup, max_tokens: int = 0) -> None:
        super().__init__(num_experts, dist.get_rank(group), dist.get_world_size(group))
        if self.world_size > MAX_RANKS or self.num_local_experts > MAX_LOCAL_EXPERTS:
            raise BackendUnavailable(
                f"dispatcher 'symm_mem' supports at most {MAX_RANKS} ranks and {MAX_LOCAL_EXPERTS} experts per "
                f"rank, got {self.world_size} ranks x {self.num_local_experts}; use 'all_to_all' instead"
            )
        self.group, self.max_tokens = group, max_tokens
        if group not in _BUFFERS:
            _BUFFERS[group] = _Buffers(group)
        self.bufs = _BUFFERS[group]

    def dispatch(self, x_TD, topk_idx_TK, topk_weights_TK):
        (T, D), K = x_TD.shape, topk_idx_TK.shape[1]
        C = self.bufs.ensure(T, self.max_tokens, K, D, self.num_local_experts, x_TD.dtype, x_TD.device)
        order_M, counts_E, num_kept = sort_by_expert(topk_idx_TK, self.num_experts, self.may_drop)
        rows_MD = expand_tokens(x_TD, order_M[:num_kept], K)
        route = _Route(counts_E, num_kept, self.world_size * C * K)
        x_ND = _Dispatch.apply(rows_MD, route, self.bufs)
        counts_L = route.splits.view(self.num_local_experts, self.world_size).sum(1)
        return x_ND, counts_L, SymmMemHandle(route, order_M, num_kept, topk_weights_TK)

    def combine(self, y_ND, handle: SymmMemHandle):
        dtype = self.bufs.key[3]
        rows_MD = _Combine.apply(y_ND.to(dtype), handle.route, self.bufs).to(y_ND.dtype)
        return weighted_sum_over_slots(rows_MD, handle.order_M, handle.num_kept, handle.topk_weights_TK)


__all__ = ["MAX_LOCAL_EXPERTS", "MAX_RANKS", "SymmMemDispatcher", "SymmMemHandle", "symm_mem_unavailable_reason"]
