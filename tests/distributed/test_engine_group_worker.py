"""A rollout worker with rollout.ep_size = 2 (its process rank 0, one child process rank 1, gloo) against a worker
with ep_size = 1 in the same process: the same published weights (expert tensors cut as a trainer with EP 4
publishes them, re-cut by each rank), the same group, the same completions (tokens, log-probs 1e-5, routing);
an abort on the group (a request on the follower rank) continued on the single engine stays exact; a killed
follower fails the worker's requests and pings at once.

Both workers live in one child process (they set up torch.distributed, which must not happen in pytest's own).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed
DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.toml")
TRAINER_EP = 4  # the published expert slices: 4 of 2 experts each, re-cut into 2 of 4 by the engine group


def published(arch, seed: int):
    """Weights as a trainer with EP 4 publishes them: dense tensors whole, expert tensors in 4 offset slices."""
    from moerl.model import build_model
    from moerl.model.moe import is_expert_param

    items = []
    for name, t in build_model(arch, seed=seed).state_dict().items():
        if is_expert_param(name):
            n = t.shape[0] // TRAINER_EP
            items.extend((name, t[i * n:(i + 1) * n].clone(), i * n) for i in range(TRAINER_EP))
        else:
            items.append((name, t, None))
    return items


def child(out_path: str) -> None:
    from moerl.actors.rollout_worker import RolloutWorker
    from moerl.actors.weight_sync import pack_bucket
    from moerl.config import load_config
    from moerl.loop.types import GroupTask
    from moerl.model import build_model
    from moerl.rollout import SamplingParams
    from moerl.run import _specs, model_architecture
    from moerl.tasks.base import load_task

    cfg = load_config(DEMO, ["--rollout.ep_size=2", "--rollout.max_batch_size=4", "--rollout.max_new_tokens=6"])
    task = load_task(cfg.task.name, dict(cfg.task.options), seed=cfg.run.seed)
    arch = model_architecture(cfg, task)
    spec, _ = _specs(cfg, arch, task)
    spec = dataclasses.replace(spec, device="cpu", dtype="float32")
    group_worker = RolloutWorker("ep2", spec)
    single = RolloutWorker("ep1", dataclasses.replace(spec, ep_size=1))
    bucket = pack_bucket(published(arch, seed=1))
    results = {"versions": [w.update_weights(3, [bucket]) for w in (group_worker, single)]}
    want = build_model(arch, seed=1).state_dict()  # the weights arrived (both workers start from seed 0's)
    name = next(n for n in want if ".experts." in n)
    results["applied"] = (torch.equal(single.engine.engine.model.state_dict()[name], want[name]),
                          torch.equal(group_worker.engine.engine.model.state_dict()[name], want[name][:4]))
    prompt = task.prompt_at(7)
    gt = GroupTask("t7", 7, prompt.prompt_token_ids, group_size=5)
    results["group"] = [w.run_group(gt) for w in (group_worker, single)]

    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)

    def abort_mid_way(leader):  # on the engine thread: request 1 lands on rank 1
        ids = [leader.submit(prompt.prompt_token_ids, params, request_id=f"a{i}") for i in range(2)]
        owners = [leader.owner[i] for i in ids]
        for _ in range(4):
            leader.step()
        partial = leader.abort(ids[1])
        while leader.has_unfinished():
            leader.step()
        return owners, partial

    results["owners"], partial = group_worker.engine.call(abort_mid_way)
    results["partial"] = partial
    results["continued"], results["whole"] = single.engine.call(
        lambda e: (e.generate([prompt.prompt_token_ids], params, prefixes=[partial])[0],
                   e.generate([prompt.prompt_token_ids], params)[0]))
    # A refused weight update (an unknown parameter, on every rank) leaves the group serving.
    try:
        group_worker.update_weights(5, [pack_bucket([("no.such.weight", torch.zeros(2), None)])])
        results["bad_update"] = "accepted"
    except KeyError:
        results["bad_update"] = "refused"
    results["after_bad_update"] = group_worker.run_group(gt).status
    # A lost rank fails the worker at once: the engine thread dies, the request fails, the pings fail (so the
    # pool replaces the whole worker).
    os.kill(group_worker.engine.engine.processes[0].pid, signal.SIGKILL)
    fut = group_worker.engine.submit(prompt.prompt_token_ids, params, "after-loss")
    t0 = time.monotonic()
    try:
        fut.result(timeout=30)
        results["lost"] = "no error"
    except Exception as e:  # noqa: BLE001 - what the worker's group would see
        results["lost"] = (type(e).__name__, time.monotonic() - t0)
    try:
        group_worker.ping()
        results["ping"] = "answered"
    except RuntimeError as e:
        results["ping"] = str(e)
    Path(out_path).write_bytes(pickle.dumps(results))
    for w in (group_worker, single):
        w.engine.stop()


def assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
    assert torch.equal(got.routed_experts, want.routed_experts)
    assert got.versions == want.versions


def test_worker_with_an_engine_group_equals_a_single_engine_worker(tmp_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "moerl.actors.rollout_worker", "moerl.run", __name__])
    out = tmp_path / "results.pkl"
    proc = ctx.Process(target=child, args=(str(out),))
    proc.start()
    proc.join(90)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    assert proc.exitcode == 0 and out.is_file(), f"the worker process ended with {proc.exitcode}"
    r = pickle.loads(out.read_bytes())
    assert r["versions"] == [3, 3] and r["applied"] == (True, True)
    got, want = r["group"]
    assert got.status == want.status == "ok" and got.rewards == want.rewards
    for g, w in zip(got.completions, want.completions):
        assert_same(g, w)
    assert r["owners"] == [0, 1]
    partial = r["partial"]
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 8
    assert_same(r["continued"], r["whole"])
    assert (r["bad_update"], r["after_bad_update"]) == ("refused", "ok")
    assert r["lost"][0] == "RuntimeError" and r["lost"][1] < 10, r["lost"]
    assert r["ping"].startswith("engine thread died"), r["ping"]
