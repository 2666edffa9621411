"""Packed variable-length sequences: several sequences laid end to end in one row, no padding.

Shape legend: S sequences, T packed positions (the sum of the lengths), n one sequence's length, P the longest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class PaddedIndex:
    """A packed row as a right-padded [S, P] batch, for attention where no varlen kernel runs: causal SDPA on
    the padded copy costs about S P^2, the block mask T^2 (the CPU demo: 64 x 8^2 = 4k against 420^2 = 176k).

    Padding slots repeat their sequence's last position: causal attention never lets a real query see them,
    and their outputs are dropped, so they get exactly zero gradient."""

    gather_SP: torch.Tensor  # long [S, P]: the packed position at (sequence, slot)
    scatter_T: torch.Tensor  # long [T]: each packed position's flat index s * P + p in the [S, P] grid

    def to(self, device: torch.device | str) -> PaddedIndex:
        return PaddedIndex(self.gather_SP.to(device), self.scatter_T.to(device))


@dataclass(frozen=True, eq=False)  # eq=False: tensors don't compare to a bool
class PackedSeqs:
    """Where each sequence of a packed row starts and ends: sequence s is positions [cu[s], cu[s+1]).

    Attention stays causal inside a sequence and never crosses into another; position ids restart at 0.
    `total_len` is read from `cu_seqlens_S1` once (one host sync) unless given, so the model can check
    its input's length without waiting on the device every forward.
    """

    cu_seqlens_S1: torch.Tensor  # int32 [S+1], starts at 0 (the form flash varlen kernels take)
    max_len: int  # the longest sequence (the kernels size their grid by it)
    total_len: int = field(default=-1)  # T = cu_seqlens[-1]
    padded: PaddedIndex | None = None  # set (`with_padded_index`): attention runs on a right-padded copy

    def __post_init__(self) -> None:
        cu = self.cu_seqlens_S1
        if cu.dim() != 1 or cu.numel() < 2 or cu.dtype != torch.int32:
            raise ValueError(
                f"cu_seqlens must be an int32 tensor [num_seqs + 1] with at least one sequence, "
                f"got {cu.dtype} {tuple(cu.shape)}"
            )
        if self.total_len < 0:
            object.__setattr__(self, "total_len", int(cu[-1]))

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device | str | None = None) -> PackedSeqs:
        lengths = [int(n) for n in lengths]
        if not lengths or min(lengths) < 1:
            raise ValueError(f"packing needs at least one sequence and every length >= 1, got lengths {lengths}")
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return cls(torch.tensor(cu, dtype=torch.int32, device=device), max(lengths), cu[-1])

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_S1.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_S1.device

    def lengths(self) -> list[int]:
        """The sequence lengths (a host sync)."""
        return self.cu_seqlens_S1.diff().tolist()

    def to(self, device: torch.device | str) -> PackedSeqs:
        padded = self.padded.to(device) if self.padded is not None else None
        return PackedSeqs(self.cu_seqlens_S1.to(device), self.max_len, self.total_len, padded)

    def padding_is_cheaper(self) -> bool:
        """Whether causal attention on the right-padded [S, P] copy (about S P^2) costs no more than on the
        packed row under the block mask (T^2): unless one sequence is much longer than most."""
        return self.num_seqs * self.max_len**2 <= self.total_len**2

    def with_padded_index(self) -> PackedSeqs:
        """This packing, with the index of its right-padded [S, P] copy (no host sync)."""
        P = self.max_len
        start_S = self.cu_seqlens_S1[:-1].long()
        last_S = self.cu_seqlens_S1[1:].long() - 1
        gather_SP = torch.minimum(start_S[:, None] + torch.arange(P, device=self.device), last_S[:, None])
        seq_T = self.seq_ids()
        scatter_T = seq_T * P + torch.arange(self.total_len, device=self.device) - start_S[seq_T]
        return PackedSeqs(self.cu_seqlens_S1, P, self.total_len, PaddedIndex(gather_SP, scatter_T))

    def seq_ids(self) -> torch.Tensor:
        """[T] long: which sequence each packed position belongs to (no host sync)."""
        lengths_S = self.cu_seqlens_S1.diff()
        return torch.repeat_interleave(
            torch.arange(self.num_seqs, device=self.device), lengths_S, output_size=self.total_len
        )

    def position_ids(self) -> torch.Tensor:
        """[1, T] long: 0 .. n-1 within each sequence."""
        seq_T = self.seq_ids()
        start_T = self.cu_seqlens_S1.long()[seq_T]
        return (torch.arange(self.total_len, device=self.device) - start_T)[None]

    def causal_block_mask(self) -> torch.Tensor:
        """[1, 1, T, T] bool, True = attend: causal inside each sequence, nothing across sequences.

        O(T^2) memory: the fallback for devices and dtypes without a varlen attention kernel."""
        seq_T = self.seq_ids()
        same_TT = seq_T[:, None] == seq_T[None, :]
        return torch.tril(same_TT)[None, None]

    def split(self, x_1T: torch.Tensor) -> list[torch.Tensor]:
        """Cut a packed [1, T, ...] tensor into the per-sequence [1, n, ...] tensors (a host sync)."""
        if x_1T.shape[:2] != (1, self.total_len):
            raise ValueError(f"expected a packed tensor [1, {self.total_len}, ...], got {tuple(x_1T.shape)}")
        return list(torch.split(x_1T, self.lengths(), dim=1))

    @staticmethod
    def pack(xs_1n: Sequence[torch.Tensor]) -> torch.Tensor:
        """Lay per-sequence [1, n, ...] tensors end to end: [1, T, ...] (the inverse of `split`)."""
        if any(x.dim() < 2 or x.shape[0] != 1 for x in xs_1n):
            raise ValueError(f"pack takes [1, n, ...] tensors, got shapes {[tuple(x.shape) for x in xs_1n]}")
        return torch.cat(list(xs_1n), dim=1)
