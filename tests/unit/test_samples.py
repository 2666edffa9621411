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


class _CharTokenizer:
    """A fake tokenizer: id = ord(character); 0 is EOS."""

    vocab_size, eos_token_id, pad_token_id, bos_token_id = 256, 0, 0, None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids if i)


class _EchoTask:
    """Prompt i is "q{i}?" with answer "a{i}"; prompt 3 raises (a task bug must not fail the log)."""

    tokenizer = _CharTokenizer()

    def prompt_at(self, index: int):
        from moerl.tasks.base import Prompt

        if index == 3:
            raise KeyError(index)
        return Prompt(f"q-{index}", index, self.tokenizer.encode(f"q{index}?"), f"q{index}?", f"a{index}")

    def reward(self, prompt, completion_token_ids):
        return 0.0


def _group(index: int, texts: list[str], rewards: list[float | None], finish: str = "stop") -> GroupResult:
    tok = _CharTokenizer()
    completions = [Completion("r", tok.encode(f"q{index}?"), tok.encode(t) + ([0] if finish == "stop" else []),
                              [-1.0] * (len(t) + (finish == "stop")), [0] * (len(t) + (finish == "stop")), None,
                              finish) for t in texts]
    return GroupResult(f"q-{index}", index, "w", "ok", completions, rewards)


def test_health_metrics_and_trajectory_text():
    import pytest

    groups = [_group(1, ["a1", "b", "a1"], [1.0, 0.0, 1.0]),        # std sqrt(2)/3, not all equal
              _group(2, ["x", "y", "z"], [0.0, 0.0, None]),         # all equal (one failed sample left out)
              _group(3, ["abcd", "abcd", "abcd"], [0.5, 0.5, 0.5], finish="length")]  # all equal, clipped
    builder = SampleBuilder(_EchoTask(), True, 0, 1)
    _, rows, stats = builder.build(groups, step=4, version=4)
    assert stats["reward/group_std"] == pytest.approx((2 ** 0.5 / 3) / 3)  # mean over the 3 groups
    assert stats["reward/all_equal_frac"] == pytest.approx(2 / 3)
    assert stats["length/max"] == 4 and stats["length/mean"] == pytest.approx((3 + 2 + 3 + 2 + 2 + 12) / 8)
    assert stats["length/clipped_frac"] == pytest.approx(3 / 8)
    assert "prompt" not in rows[0]  # text is decoded later, off the trainer's critical path
    with pytest.warns(RuntimeWarning, match="trajectory text left out: KeyError"):
        builder.add_text(rows)
    assert [(r["prompt"], r["completion"], r["answer"]) for r in rows[:3]] == [
        ("q1?", "a1", "a1"), ("q1?", "b", "a1"), ("q1?", "a1", "a1")]
    assert rows[0]["completion_ids"] == [97, 49, 0] and rows[0]["prompt_index"] == 1
    assert (rows[-1]["prompt"], rows[-1]["completion"], rows[-1]["answer"]) == (None, "abcd", None)
    assert list(rows[0])[-4:] == ["prompt", "completion", "answer", "completion_ids"]  # the ids last
