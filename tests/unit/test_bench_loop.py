"""`moerl bench loop`'s ceiling, the engine alone: its occupancy arithmetic on known counters, and a short CPU
run of the demo's engine that reports it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from moerl.bench import loop


def test_occupancy_from_the_counters_at_both_ends():
    before = {"decode_tokens": 100, "decode_steps": 10, "prefill_tokens": 50, "steps": 12}
    after = {"decode_tokens": 1720, "decode_steps": 20, "prefill_tokens": 230, "steps": 32}
    got = loop.occupancy(before, after, slots=256, wall=0.5)
    assert got["decode_rows"] == pytest.approx(162.0)  # 1,620 decode tokens over 10 decode steps
    assert got["step_ms"] == pytest.approx(25.0)  # 500 ms over 20 engine steps
    assert got["prefill_share"] == pytest.approx(180 / 1800)
    assert got["slots"] == 256


def test_occupancy_of_an_idle_window_divides_by_nothing():
    same = {"decode_tokens": 5, "decode_steps": 1, "prefill_tokens": 5, "steps": 2}
    got = loop.occupancy(same, same, slots=8, wall=1.0)
    assert got["decode_rows"] == 0 and got["prefill_share"] == 0 and got["step_ms"] == 1000.0


def test_engine_alone_on_the_cpu_demo_reports_its_batch():
    args = argparse.Namespace(config=str(Path(__file__).parents[2] / "configs" / "demo.toml"), steps=None, set=[])
    got = loop.engine_alone(args, gpu=False, inflight_groups=2, seconds=0.5)
    assert got["samples_per_s"] > 0 and got["tokens_per_s"] > 0
    assert 0 < got["decode_rows"] <= got["slots"] and got["step_ms"] > 0 and 0 < got["prefill_share"] < 1
