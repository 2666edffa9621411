"""`moerl bench rollout --profile` (moerl/bench/decode_profile.py) and `--overlap-ablation`: the device timeline's
arithmetic on known spans, a CPU profile of the tiny engine, and the overlap switch restored. Not timings."""

from __future__ import annotations

import re

import pytest
import torch

from moerl.bench import decode_profile, rollout
from moerl.rollout import Engine, EngineConfig


def test_busy_time_is_the_union_of_the_spans_and_the_gaps_lie_between():
    spans = [("a", 0.0, 10.0), ("b", 5.0, 12.0), ("c", 20.0, 25.0), ("a", 30.0, 31.0), ("d", 24.0, 26.0)]
    busy, gaps = decode_profile.busy_and_gaps(spans)
    assert busy == pytest.approx(12 + 6 + 1)  # [0, 12], [20, 26], [30, 31]
    assert gaps == pytest.approx([8.0, 4.0])
    assert decode_profile.busy_and_gaps([]) == (0.0, [])


def test_top_kernels_rank_names_by_total_time():
    spans = [("a", 0.0, 1.0), ("b", 1.0, 4.0), ("a", 4.0, 7.0), ("c", 7.0, 7.5)]
    assert decode_profile.top_kernels(spans, 2) == [("a", 4.0, 2), ("b", 3.0, 1)]


@pytest.fixture
def tiny_engine():
    config = rollout.PRESETS["tiny"].config()
    model = rollout.random_model(config, torch.float32, torch.device("cpu"), seed=0)
    prompts = torch.randint(0, config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0)).tolist()
    return model, prompts, lambda overlap: Engine(model, EngineConfig(max_batch_size=2, max_seq_len=4 + 16,
                                                                      overlap_decode=overlap))


def test_cpu_profile_prints_each_part_and_leaves_the_engine_empty(tiny_engine, capsys):
    _, prompts, make = tiny_engine
    engine = make(False)
    decode_profile.profile_decode(engine, prompts, 1.0, 16, steps=3)
    out = capsys.readouterr().out
    assert "decode profile, eager mode, 2 rows, 3 steps" in out
    assert re.search(r"^\(a\) [\d.]+ ms/step wall, profiler off; [\d.]+ ms/step with it$", out, re.M), out
    assert "(b) top ops by self CPU time" in out and "(c) A whole step under cProfile" in out
    assert not engine.has_unfinished()


def test_overlap_ablation_runs_with_overlap_off_and_restores_it(tiny_engine, monkeypatch):
    model, prompts, make = tiny_engine
    engine = make(True)
    seen, real = [], rollout.run_engine
    monkeypatch.setattr(rollout, "run_engine", lambda e, *a: seen.append(e.pipeline.overlap) or real(e, *a))
    got = rollout._run_without_overlap(engine, model, prompts, 8, 1.0)
    assert seen == [False] and engine.pipeline.overlap and got["decode_tok_s"] > 0
    assert rollout._run_without_overlap(make(False), model, prompts, 8, 1.0) is None  # off already: nothing to ablate
