"""From trained samples to what one forward pass takes: ranks balanced by tokens, micro-batches under a token
budget, and variable-length packing (no padding rows).

Shape legend: S sequences in a micro-batch, T packed positions (the sum of the sequences' lengths), L MoE
layers, K experts per token, P the longest sequence of the micro-batch.

A sample of prompt p and completion c runs p + c - 1 positions: inputs `(prompt + completion)[:-1]`, targets
`(prompt + completion)[1:]`, the completion's targets at positions p - 1 .. p + c - 2 (the ones the loss sees).
Packing concatenates the samples' positions into one row; the model restarts position ids and confines
attention at each boundary (moerl/model/packing.py), and routing replay reads each position's own experts.
The per-token values come back to a [S, P] grid for the loss (small: no vocabulary dimension).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerl.model.packing import PackedSeqs
from moerl.train.sample import Sample


def positions(sample: Sample) -> int:
    """The positions a sample runs through the model (its real tokens in a micro-batch)."""
    return len(sample.prompt_ids) + len(sample.completion_ids) - 1


def split_by_tokens(samples: list[Sample], num_ranks: int) -> list[list[Sample]]:
    """`num_ranks` shares of about equal tokens: the longest sample first, each to the share with the fewest
    tokens so far (ties to the lowest rank). Deterministic; each share keeps the samples' input order."""
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for i in sorted(range(len(samples)), key=lambda i: (-positions(samples[i]), i)):
        r = min(range(num_ranks), key=lambda r: (tokens[r], r))
        shares[r].append(i)
        tokens[r] += positions(samples[i])
    return [[samples[i] for i in sorted(share)] for share in shares]


def split_contiguous(samples: list[Sample], parts: int) -> list[list[Sample]]:
    """`parts` contiguous runs of about equal tokens, in order (a step's optimizer updates: the samples of one
    group stay together where the token counts allow). Each sample goes to the run its first token falls in;
    runs may be empty when there are fewer samples than parts."""
    if parts <= 1:
        return [list(samples)]
    total = sum(positions(s) for s in samples)
    runs: list[list[Sample]] = [[] for _ in range(parts)]
    seen = 0
    for s in samples:
        runs[min(parts - 1, seen * parts // max(total, 1))].append(s)
        seen += positions(s)
    return runs


def micro_batches(samples: list[Sample], budget: int) -> list[list[Sample]]:
    """First-fit decreasing into micro-batches of at most `budget` positions; a sample longer than the budget
    is a micro-batch of its own. budget <= 0: one micro-batch of everything."""
    if budget <= 0 or not samples:
        return [list(samples)] if samples else []
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(samples)), key=lambda i: (-positions(samples[i]), i)):
        n = positions(samples[i])
        b = next((b for b in range(len(bins)) if room[b] >= n), None)
        if b is None:
            bins.append([])
            room.append(budget)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= n
    return [[samples[i] for i in sorted(b)] for b in bins]


@dataclass
class PackedBatch:
    input_ids_1T: torch.Tensor  # int64
    target_ids_1T: torch.Tensor  # int64
    packed: PackedSeqs  # the sequences' boundaries, as the model takes them
    seq_T: torch.Tensor  # int64: which sequence each position belongs to
    pos_T: torch.Tensor  # int64: the position within its sequence
    mask_SP: torch.Tensor  # bool: True where the target is a completion token (the loss's tokens)
    behaviour_SP: torch.Tensor  # float32: the rollout's log-prob of each completion target
    advantages_S: torch.Tensor  # float32
    routed_1TLK: torch.Tensor | None  # int64 experts the rollout chose per position; None = no replay

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_1T.shape[1])

    def to_grid(self, values_T: torch.Tensor) -> torch.Tensor:
        """Per-position values [T] (or [1, T]) as the [S, P] grid of the loss; zeros past each sequence's end."""
        values_T = values_T.reshape(-1)
        grid_SP = values_T.new_zeros(self.mask_SP.shape)
        return grid_SP.index_put((self.seq_T, self.pos_T), values_T)


def pack(samples: list[Sample], num_moe_layers: int, top_k: int, device: torch.device | str,
         pad_token_id: int = 0) -> PackedBatch:
    """One packed row of every sample. An empty list gives a one-position batch with nothing to learn from
    (a rank with fewer micro-batches than the others runs these, so every rank joins every collective)."""
    if not samples:
        return _empty(num_moe_layers, top_k, device, pad_token_id)
    lengths = [positions(s) for s in samples]
    S, P = len(samples), max(lengths)
    ids, targets, routed = [], [], []
    mask, behaviour = torch.zeros(S, P, dtype=torch.bool), torch.zeros(S, P)
    have_routing = all(s.routed_experts is not None for s in samples)
    for i, (s, n) in enumerate(zip(samples, lengths)):
        seq, p = s.prompt_ids + s.completion_ids, len(s.prompt_ids)
        if len(s.behaviour_logprobs) != len(s.completion_ids):
            raise ValueError(f"sample {i}: {len(s.behaviour_logprobs)} behaviour log-probs for "
                             f"{len(s.completion_ids)} completion tokens")
        ids.extend(seq[:-1])
        targets.extend(seq[1:])
        mask[i, p - 1: n] = True
        if s.loss_mask is not None:  # observation tokens of a multi-turn episode: inputs only, no loss
            if len(s.loss_mask) != len(s.completion_ids):
                raise ValueError(f"sample {i}: loss_mask has {len(s.loss_mask)} entries for "
                                 f"{len(s.completion_ids)} completion tokens")
            mask[i, p - 1: n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        behaviour[i, p - 1: n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        if have_routing:
            if tuple(s.routed_experts.shape) != (n, num_moe_layers, top_k):
                raise ValueError(f"sample {i}: routed_experts has shape {list(s.routed_experts.shape)}, expected "
                                 f"[prompt + completion - 1, moe_layers, top_k] = {[n, num_moe_layers, top_k]}")
            routed.append(s.routed_experts.long())
    packed = PackedSeqs.from_lengths(lengths, device)
    return PackedBatch(torch.tensor([ids], device=device), torch.tensor([targets], device=device), packed,
                       packed.seq_ids(), packed.position_ids()[0], mask.to(device), behaviour.to(device),
                       torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
                       torch.cat(routed)[None].to(device) if have_routing else None)


def _empty(num_moe_layers: int, top_k: int, device: torch.device | str, pad_token_id: int) -> PackedBatch:
    one = torch.full((1, 1), pad_token_id, dtype=torch.long, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    routed = torch.arange(top_k, device=device).expand(1, 1, num_moe_layers, top_k).clone()
    return PackedBatch(one, one.clone(), PackedSeqs.from_lengths([1], device), zero, zero.clone(),
                       torch.zeros(1, 1, dtype=torch.bool, device=device),
                       torch.zeros(1, 1, device=device), torch.zeros(1, device=device), routed)
