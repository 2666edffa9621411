"""`moerl bench ray-fleet` without Ray: the stub engine keeps the engine's contract (lengths by sample, so a
continuation elsewhere ends where the first would have; aborts hand back partials; weights land through the real
apply_weights), and the extrapolation to 256 workers. A run of 2 workers: tests/integration/test_ray_fleet_run.py."""

from __future__ import annotations


import pytest
import torch

from moerl.actors.weight_sync import apply_weights
from moerl.bench import ray_fleet
from moerl.bench.ray_fleet import Phase, StubEngine, StubShape
from moerl.rollout import SamplingParams


def run(engine: StubEngine) -> dict:
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.completion
    return done


def test_stub_engine_finishes_at_lengths_drawn_per_sample_and_continues_a_partial():
    shape = StubShape(lengths=(3, 5, 8), tokens_per_s=100.0, step_s=0.01, weight_mb=0.01)
    engine = StubEngine(shape)
    ids = [f"arith-000001/{i}/0" for i in range(6)]
    for rid in ids:
        engine.submit([1, 2], SamplingParams(), request_id=rid)
    first = run(engine)
    assert all(len(c.token_ids) in shape.lengths and c.finish_reason == "length" for c in first.values())
    assert len({len(c.token_ids) for c in first.values()}) > 1, "one length for every sample"
    assert engine.stats["decode_tokens"] == sum(len(c.token_ids) for c in first.values())

    again = StubEngine(shape)  # another worker: the sample aborted after one step, then continued
    again.submit([1, 2], SamplingParams(), request_id=ids[0])
    again.step()
    partial = again.abort(ids[0])
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < len(first[ids[0]].token_ids)
    third = StubEngine(shape)
    third.submit([1, 2], SamplingParams(), request_id=f"{ids[0].rsplit('/', 1)[0]}/1", prefix=partial)
    (cont,) = run(third).values()
    assert len(cont.token_ids) == len(first[ids[0]].token_ids) and cont.token_ids[: len(partial.token_ids)] == \
        partial.token_ids and cont.versions[0] == -1


def test_stub_engine_takes_weights_through_apply_weights():
    engine = StubEngine(StubShape(weight_mb=0.001))
    n = engine.model.w.numel()
    apply_weights(engine, [("w", torch.full((n,), 7.0), None)], version=3)
    assert engine.version == 3 and torch.all(engine.model.w == 7.0)


def test_driver_cost_is_extrapolated_by_a_line_through_the_sizes():
    def row(n: int, cores: float) -> dict:
        return {"workers": n, "steady": Phase(wall_s=10.0, driver_cpu_s=10.0 * cores, groups=100)}

    slope, at256 = ray_fleet.extrapolate([row(8, 0.1), row(16, 0.2), row(32, 0.4)])
    assert slope == pytest.approx(0.0125) and at256 == pytest.approx(3.2)
    assert ray_fleet.extrapolate([row(8, 0.1), row(16, 0.1)]) == (pytest.approx(0.0), pytest.approx(0.1))


def test_cpu_and_memory_of_a_process_are_read_from_proc():
    import os

    assert ray_fleet.cpu_s(os.getpid()) > 0 and ray_fleet.pss_mb(os.getpid()) > 10
    assert ray_fleet.cpu_s(2**22 + 12345) == 0.0  # gone (above the default pid_max)
