"""SampleBuilder: GRPO advantages per group, failed samples left out, and the rollout's expert load counted
over the whole batch equal to a per-token count."""

from __future__ import annotations

import torch

from moerl.loop.samples import SampleBuilder
from moerl.loop.types import GroupResult
from moerl.rollout.types import Completion
from moerl.tasks.arithmetic import ArithmeticTask


def _completion(g: torch.Generator, layers: int, experts: int, with_routing: bool = True) -> Completion:
    prompt, tokens = [1, 2, 3], torch.randint(3, 9, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    routed = torch.randint(0, experts, (len(prompt) + len(tokens) - 1, layers, 2), generator=g, dtype=torch.int16)
    return Completion("r", prompt, tokens, [-1.0] * len(tokens), [0] * len(tokens),
                      routed if with_routing else None, "stop")


def test_expert_counts_and_failed_samples():
    g = torch.Generator().manual_seed(0)
    L, E = 3, 5
    groups = [GroupResult(f"t-{k}", k, "w", "ok", [_completion(g, L, E, with_routing=k != 1) for _ in range(4)],
                          [1.0, None, 0.0, 0.5]) for k in range(3)]
    samples, rows, stats = SampleBuilder(ArithmeticTask(), True, L, E).build(groups, step=0, version=0)
    assert len(samples) == len(rows) == 9 and stats["samples_failed"] == 3
    want = torch.zeros(L, E, dtype=torch.long)
    for grp in groups:
        for c, r in zip(grp.completions, grp.rewards):
            if r is not None and c.routed_experts is not None:
                for token in c.routed_experts.tolist():
                    for layer, chosen in enumerate(token):
                        for e in chosen:
                            want[layer, e] += 1
    assert stats["expert_counts_rollout"] == want.tolist()
    assert abs(sum(s.advantage for s in samples[:3])) < 1e-5  # group-normalised within each group
