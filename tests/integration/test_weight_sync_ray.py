"""Weight sync through real Ray actors on one machine: after every sync each rollout worker's engine holds the
trainer's published weights bitwise, for the shared (/dev/shm, the twin of CUDA IPC) and broadcast (gloo, the twin
of NCCL) transports, including a worker that starts late (catch-up) and a trainer with two expert-parallel ranks
(expert slices from two ranks land at their offsets)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from moerl.config import load_config

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _published(ray, ranks) -> list[dict[str, torch.Tensor]]:
    """What each trainer rank publishes (all at once: gathering FSDP shards is a collective)."""
    return ray.get([r.__ray_call__.remote(lambda self: self.trainer.publish_state()) for r in ranks], timeout=60)


def _engine_state(ray, handle) -> dict[str, torch.Tensor]:
    return ray.get(handle.__ray_call__.remote(lambda self: {k: v.clone() for k, v in
                                                             self.engine.engine.model.state_dict().items()}),
                   timeout=60)


def _start(pool, deadline_s: float = 120.0) -> None:
    deadline = time.monotonic() + deadline_s
    while len(pool.started_workers()) < pool.target:
        assert time.monotonic() < deadline, "workers did not start"
        pool.unresponsive(time.monotonic())
        time.sleep(0.05)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport,ranks", [("shared", 2), ("broadcast", 2)])  # the object store: the other tests
def test_engines_equal_the_trainer_after_every_sync(shared_ray, tmp_path, transport, ranks):
    from moerl.actors.pools import RayRolloutPool, RayTrainerGroup
    from moerl.actors.weight_sync.sync import RayWeightSync
    from moerl.loop.work_queue import WorkQueue
    from moerl.run import _specs, model_architecture
    from moerl.tasks.base import load_task
    from moerl.train.sample import Sample

    ray = shared_ray
    cfg = load_config(REPO / "configs" / "demo.toml", [f"--run.dir={tmp_path}", f"--train.num_ranks={ranks}",
                                                        f"--ep.size={ranks}", "--rollout.heartbeat_s=0.2"])
    task = load_task(cfg.task.name, dict(cfg.task.options), seed=0)
    arch = model_architecture(cfg, task)
    worker_spec, trainer_spec = _specs(cfg, arch, task)
    trainer = RayTrainerGroup(trainer_spec, ranks, 0.5, 0)
    pool = RayRolloutPool(worker_spec, 1, 0.5, 0, WorkQueue(lease_timeout=600, max_attempts=3), heartbeat_s=0.2)
    sync = RayWeightSync(trainer, pool, transport, bucket_bytes=64 << 10)  # small buckets: many of them
    assert sync.transport == transport
    _start(pool)
    g = torch.Generator().manual_seed(0)
    for version in (1, 2, 3):
        samples = [Sample(torch.randint(3, 60, (6,), generator=g).tolist(), torch.randint(3, 60, (5,), generator=g).tolist(),
                          [0.0] * 5, 0.0, None) for _ in range(4)]
        trainer.sft_step(samples)
        sync.publish(version)
        sync.deliver(wait=True)
        if version == 2:  # a second worker starts late and catches up with version 2
            pool.target = 2
            pool.replace_missing(version)
            _start(pool)
        want: dict[str, torch.Tensor] = {}
        for share in _published(ray, trainer.ranks):  # rank 0: the dense tensors and its expert slice, rank 1: its slice
            for name, t in share.items():
                want[name] = torch.cat([want[name], t]) if name in want else t
        for _, handle, _ in pool.started_workers():
            got = _engine_state(ray, handle)
            assert sorted(got) == sorted(want)
            assert [k for k in want if not torch.equal(got[k], want[k])] == [], f"version {version}"
    assert sync.stats[f"{transport}_publishes"] >= 2  # version 1 may go to the store: no worker was up yet
    if transport == "broadcast":  # the late worker caught up from the store, then joined a new generation
        assert sync.stats["broadcast_generations"] == 2 and sync.stats["broadcast_failures"] == 0
