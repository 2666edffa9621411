"""`moerl bench ray-fleet` at 2 workers: real RolloutWorker actors over the stub engine start, take leases and
weights, survive a preemption storm (one SIGTERMed, its groups handed back and replaced), and the report states
the costs and the extrapolation to 256 workers; no group lost or completed twice (the bench raises otherwise)."""

from __future__ import annotations

import pytest

from moerl.bench import ray_fleet

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_two_workers_start_work_and_weather_a_storm(capsys, monkeypatch, no_ray):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    assert ray_fleet.main(["--workers", "2", "--seconds", "2", "--publish-s", "0.5", "--storm", "0.5",
                           "--lengths", "32,64", "--heartbeat-s", "0.5"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("2 |"))
    cells = [c.strip() for c in row.split("|")]
    assert float(cells[2]) > 0 and float(cells[3]) > 0, row  # groups/s, driver cores
    storm = [c.strip() for c in cells[-1].split(",")]
    assert storm[0] == "1", row  # one of the two SIGTERMed
    assert "cores at 256 workers" in out and "No group lost or completed twice; replacements caught up: True" in out
    assert not ray.is_initialized()
