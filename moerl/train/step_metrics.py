"""How a trainer step's metrics add up: over micro-batches (one rank, one optimizer update), over the updates of a
step (`train.minibatches`), and over the ranks (the driver's view of the step).

Kinds of keys: losses normalised by global counts and counts add up within an update and over ranks; extremes
take the extreme; times add up over updates and take the slowest rank; everything else is a mean over this rank's
tokens, weighted by them. The effective sample size (`is/ess`) is not a mean: an update computes it from the
global sums of the weights (`is/w_sum`, `is/w_sq_sum`), and a step from the sums of its updates.
"""

from __future__ import annotations

from moerl.train.loss import effective_sample_size

_SUMMED = ("loss/", "tokens", "sequences", "is/masked_tokens", "is/w_sum", "is/w_sq_sum")  # over micro-batches
_SAME_ON_EVERY_RANK = ("tokens", "grad_norm", "lr", "expert_counts", "is/ess", "optim/")  # all-reduced or shared
_SUM_OVER_RANKS = ("loss/policy", "loss/pg", "loss/sft", "sequences", "is/masked_tokens")  # normalised by global counts


def merge_micro_batch(acc: dict[str, float], new: dict[str, float]) -> None:
    """Fold one micro-batch's metrics in: losses and counts add up, extremes take the extreme, means are
    weighted by the micro-batch's tokens."""
    w_old, w_new = acc.get("tokens", 0.0), new.get("tokens", 0.0)
    for key, value in new.items():
        if key not in acc:
            acc[key] = value
        elif key.startswith(_SUMMED):
            acc[key] += value
        elif key.endswith("_max"):
            acc[key] = max(acc[key], value)
        elif key.endswith("_min"):
            acc[key] = min(acc[key], value)
        else:
            acc[key] = (acc[key] * w_old + value * w_new) / max(w_old + w_new, 1.0)


def merge_updates(updates: list[dict]) -> dict:
    """One step's metrics (this rank) from those of its optimizer updates, each a whole update's (global counts in
    "tokens", this rank's in "rank_tokens"). Losses are the updates' mean weighted by their global tokens; counts
    and times add up; the gradient norm is the mean with its largest kept as `grad_norm_max`; per-expert counts
    add up; the rest are means weighted by this rank's tokens of each update."""
    if len(updates) == 1:
        return updates[0]
    out: dict = {}
    tokens = [float(u.get("tokens", 0.0)) for u in updates]
    rank_tokens = [float(u.get("rank_tokens", 0.0)) for u in updates]
    for key in dict.fromkeys(k for u in updates for k in u):
        present = [(u[key], t, r) for u, t, r in zip(updates, tokens, rank_tokens) if key in u]
        values = [v for v, _, _ in present]
        if key == "expert_counts":
            out[key] = [[sum(col) for col in zip(*rows)] for rows in zip(*values)]
        elif not all(isinstance(v, (int, float)) for v in values):
            out[key] = values[-1]
        elif key in ("tokens", "rank_tokens", "sequences", "is/masked_tokens", "is/w_sum", "is/w_sq_sum") \
                or key.startswith("time/"):
            out[key] = sum(values)
        elif key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        elif key == "lr":
            out[key] = values[-1]
        else:
            weights = [t for _, t, _ in present] if key.startswith("loss/") or key.startswith(_SAME_ON_EVERY_RANK) \
                else [r for _, _, r in present]
            total = sum(weights)
            out[key] = sum(v * w for v, w in zip(values, weights)) / total if total > 0 else sum(values) / len(values)
    out["grad_norm_max"] = max(float(u.get("grad_norm", 0.0)) for u in updates)
    if "is/w_sum" in out:
        out["is/ess"] = effective_sample_size(out["is/w_sum"], out["is/w_sq_sum"], out["tokens"])
    out["optim/updates"] = float(len(updates))
    return out


def merge_rank_metrics(per_rank: list[dict]) -> dict:
    """One step's metrics from every trainer rank's: losses normalised by the global counts and counts add up;
    extremes and step times (the step waits for its slowest rank) take the extreme; the rest are this rank's
    means, weighted by its tokens. (Rank 0's alone described a share of the batch.)"""
    weights = [float(m.get("rank_tokens", 0.0)) for m in per_rank]
    total = sum(weights)
    out: dict = {}
    for key, first in per_rank[0].items():
        if key == "rank_tokens":
            continue
        values = [m[key] for m in per_rank if key in m]
        if key.startswith(_SAME_ON_EVERY_RANK) or not isinstance(first, (int, float)) or len(values) != len(per_rank):
            out[key] = first
        elif key.startswith(_SUM_OVER_RANKS):
            out[key] = sum(values)
        elif key.endswith("_max") or key.startswith("time/"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = (sum(v * w for v, w in zip(values, weights)) / total if total > 0
                        else sum(values) / len(values))
    return out
