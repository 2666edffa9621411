"""A fleet that waits for capacity (issue 38 item 1) on a local multi-node Ray (`ray.cluster_utils.Cluster`, every
node on 127.0.0.1): a head for the trainer, one rollout node with room for 2 of the 3 workers, and a second rollout
node added mid-run. The run starts with rollout.min_workers = 2 while the third waits for capacity (no failed
start however long it waits), the third joins when its node comes and takes work, and nothing is lost or trained
twice.

No timing is relied on: the run cannot finish without the late worker. GatedTask's reward holds the early
workers' groups of prompts >= GATED (the run needs more prompts than that) until a worker on the added node (the
late one) has scored a group, and the node is added once step 1 is logged. The late worker is told by its node,
not by its name: which of the three Ray leaves waiting is its choice (rollout-2 came up first in one CI run).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from moerl.runlog.run_log import read_jsonl
from moerl.tasks.arithmetic import ArithmeticTask
from tests.integration.test_rl_faults import captured, check_trained_once, last_step, small_config  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
GATE_ENV = "MOERL_TEST_FLEET_GATE"
EARLY_NODES = "early-nodes"  # in the gate directory: the nodes up before the run; a worker elsewhere came late
START_S = 12  # rollout.start_timeout_s: the late worker waits for its node longer than this
GATED = 8  # prompts at this index and after wait on the early workers until the late one has worked
pytestmark = pytest.mark.integration


class GatedTask(ArithmeticTask):
    def reward(self, prompt, completion_token_ids):
        import ray

        gate = Path(os.environ[GATE_ENV])
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        if node is None:  # not on a Ray worker (the test's own process)
            return super().reward(prompt, completion_token_ids)
        if node not in (gate / EARLY_NODES).read_text().split():
            (gate / "late-worked").touch()
        elif int(prompt.task_id.rsplit("-", 1)[1]) >= GATED:
            deadline = time.monotonic() + 90  # the test fails on its own assertions past this
            while not (gate / "late-worked").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().reward(prompt, completion_token_ids)


@pytest.fixture
def cluster(tmp_path, monkeypatch, no_ray):
    """A head (the trainer's node: no `rollout` resource) and one rollout node with 2 CPUs: room for 2 workers
    of 1 CPU each. Ray's processes take this environment: the repo importable, the gate directory."""
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv(GATE_ENV, str(tmp_path / "gate"))
    # Every node on 127.0.0.1: Ray's single-machine switch, for its processes (the variable, read at their import)
    # and for this one (whose Ray may have been imported by an earlier test, reading it then).
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    (tmp_path / "gate").mkdir()
    assert not ray.is_initialized(), "a previous test left Ray running"
    # shutdown_at_exit=False: no signal handlers, so a node can be added from the test's thread (shut down below)
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False},
                    shutdown_at_exit=False)
    try:
        nodes.add_node(num_cpus=2, resources={"rollout": 1})
        ray.init(address=nodes.address)
        (tmp_path / "gate" / EARLY_NODES).write_text("\n".join(n["NodeID"] for n in ray.nodes() if n["Alive"]))
        yield nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        nodes.shutdown()


@pytest.mark.timeout(180)
def test_late_workers_join_a_running_fleet(tmp_path, cluster, captured, capfd):  # noqa: F811 - the fixture
    from moerl.run import train

    run_dir = tmp_path / "run"
    cfg = small_config(run_dir, "--task.name=tests.integration.test_fleet_growth:GatedTask",
                       f"--ray.address={cluster.address}", "--rollout.num_workers=3", "--rollout.min_workers=2",
                       "--rollout.cpus_per_worker=1", "--rollout.max_inflight_groups=1", f"--rollout.start_timeout_s={START_S}",
                       "--rollout.max_new_tokens=8", "--train.batch_groups=2", "--train.max_staleness=1",
                       "--train.sft_steps=0", "--task.reward_timeout_s=120", steps=6)
    grown = threading.Event()

    started = time.monotonic()

    def grow() -> None:  # the spot node comes once the run trains, and after rollout.start_timeout_s
        deadline = started + 120
        while (last_step(run_dir) < 1 or time.monotonic() < started + START_S + 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        cluster.add_node(num_cpus=1, resources={"rollout": 1})
        grown.set()

    grower = threading.Thread(target=grow, daemon=True)
    grower.start()
    result = train(cfg)
    grower.join(timeout=60)
    assert grown.is_set()

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    first = next(r for r in metrics if r["step"] == 1)
    assert (first["workers/alive"], first["workers/target"], first["workers/waiting"]) == (2, 3, 1), first
    assert metrics[-1]["workers/waiting"] == 0
    # Waiting for capacity for longer than rollout.start_timeout_s was not a failed start.
    assert result["counters"]["workers_lost"] == 0
    check_trained_once(run_dir, result, captured.groups, cfg.train.steps)
    out = capfd.readouterr().err  # the run's event lines (the reporter writes to stderr)
    assert re.search(r"rollout workers: \d of 3 up, 1 waiting for capacity", out), out[-3000:]
    late = re.search(r"rollout worker (rollout-\d) up \(3 of 3 up\)", out)  # the one that waited for the node
    assert late, out[-3000:]
    assert any(g.worker_id == late.group(1) for g in captured.groups), "the late worker trained nothing"
    print(result["counters"], result["queue"], *[line for line in out.splitlines() if "rollout worker" in line], sep="\n")
