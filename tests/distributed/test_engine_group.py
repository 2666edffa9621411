"""The expert-parallel engine group on gloo ranks against the single-process engine on the same weights.

Every rank builds the model with the same seed and keeps its expert slice (build_model), so the group computes
the single-process model's function. Each request's tokens (greedy and seeded sampling), log-probs (1e-5) and
routed experts must equal the single-process engine's, with uneven request counts per rank, a rank with none,
chunked prefill (ranks run different numbers of prefill forwards per step) and more requests than slots. A
request aborted on one rank and continued on the single-process engine must end as if never interrupted.

Ranks are forked from a forkserver that has imported torch and moerl once (spawning each costs seconds).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_harness import run_ranks
from moerl.model import MoEModelConfig, build_model
from moerl.rollout import Engine, EngineConfig, EngineGroup, SamplingParams

pytestmark = pytest.mark.distributed

PROMPTS = [
    [5, 17, 99, 3, 42, 8, 61],
    [11],
    [7, 7, 120, 64, 1],
    [33, 2, 90, 14, 76, 101, 9, 55, 23, 4, 87],
    [100, 6],
    [45, 46, 47, 48],
]
# Greedy, and seeded temperature-1 sampling (the noise is keyed by seed and position, not by batch or rank).
PARAMS = [SamplingParams(max_new_tokens=8, temperature=0.0) if i % 2 == 0
          else SamplingParams(max_new_tokens=8, temperature=1.0, seed=100 + i) for i in range(len(PROMPTS))]
# rank -> prompt indices. 4 slots for 6 requests, prefill chunks of 4 tokens: ranks differ in prefill forwards.
ASSIGN = {
    2: {"uneven": [[0], [1, 2, 3, 4, 5]], "one_idle": [[0, 1, 2, 3, 4, 5], []]},
    4: {"uneven": [[0, 3], [1], [], [2, 4, 5]]},
}
ABORT_STEP, ABORTED = 3, 3  # rank 0 aborts PROMPTS[ABORTED] after this many group steps


def arch() -> MoEModelConfig:
    return MoEModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1], initializer_range=0.1)


def engine_config() -> EngineConfig:
    return EngineConfig(max_batch_size=4, max_seq_len=64, prefill_chunk=4, max_prefill_tokens=8, admit_batch=1)


def worker(rank: int, world_size: int, out_dir: str) -> None:
    model = build_model(arch(), seed=0, expert_parallel_group=dist.group.WORLD, dispatcher="all_to_all").eval()
    results = {}
    for case, assign in ASSIGN[world_size].items():
        mine = assign[rank]
        group = EngineGroup(model, engine_config())
        results[case] = group.generate([PROMPTS[i] for i in mine], [PARAMS[i] for i in mine])
        results[case + "/empty_forwards"] = group.stats["empty_forwards"]
    # Abort and continue: rank 0 runs two requests and aborts one mid-way; the other ranks run theirs meanwhile.
    group = EngineGroup(model, engine_config())
    mine = [ABORTED, 0] if rank == 0 else [rank % len(PROMPTS)]
    ids = [group.submit(PROMPTS[i], PARAMS[i]) for i in mine]
    steps = 0
    while group.any_unfinished():
        group.step()
        steps += 1
        if rank == 0 and steps == ABORT_STEP:
            results["partial"] = group.abort(ids[0])
    # New weights, whole tensors as an unsplit trainer publishes them: each rank keeps its experts (last: it
    # changes the model the cases above shared).
    group = EngineGroup(model, engine_config())
    group.update_weights(build_model(arch(), seed=1).state_dict(), version=1)
    mine = list(range(rank, len(PROMPTS), world_size))
    results["new_weights"] = group.generate([PROMPTS[i] for i in mine], [PARAMS[i] for i in mine])
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


@pytest.fixture(scope="module")
def reference():
    """Single-process completions of every prompt, on the same weights and engine settings."""
    model = build_model(arch(), seed=0).eval()
    return model, Engine(model, engine_config()).generate(PROMPTS, PARAMS)


def assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
    assert torch.equal(got.routed_experts, want.routed_experts)


@pytest.fixture(scope="module", autouse=True)
def forkserver():
    mp.get_context("forkserver").set_forkserver_preload(["torch", "moerl.rollout", "moerl.model", "dist_harness",
                                                         __name__])


@pytest.mark.parametrize("world_size", [2, 4])
def test_group_equals_single_engine(tmp_path, reference, world_size):
    model, want = reference
    run_ranks(world_size, worker, str(tmp_path), start_method="forkserver", timeout=60.0)
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
    for case, assign in ASSIGN[world_size].items():
        for rank, mine in enumerate(assign):
            got = results[rank][case]
            assert len(got) == len(mine)
            for i, completion in zip(mine, got):
                assert_same(completion, want[i])
        # the lockstep padding ran: idle or less busy ranks took part with empty forwards
        assert sum(results[r][case + "/empty_forwards"] for r in range(world_size)) > 0
    partial = results[0]["partial"]
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < PARAMS[ABORTED].max_new_tokens
    continued = Engine(model, engine_config()).generate([PROMPTS[ABORTED]], [PARAMS[ABORTED]], prefixes=[partial])
    assert_same(continued[0], want[ABORTED])
    engine = Engine(build_model(arch(), seed=1).eval(), engine_config(), version=1)
    want_new = engine.generate(PROMPTS, PARAMS)
    for rank in range(world_size):
        for i, completion in zip(range(rank, len(PROMPTS), world_size), results[rank]["new_weights"]):
            assert_same(completion, want_new[i])
            assert set(completion.versions) == {1}


def bench_worker(rank: int, world_size: int, out_dir: str) -> None:
    import argparse

    from moerl.bench.rollout_ep import bench_rank

    args = argparse.Namespace(preset="tiny", requests=5, prompt_len=6, new_tokens=4, temperature=None, peer="one",
                              no_graphs=False, ep_size=world_size)
    text = bench_rank(rank, world_size, torch.device("cpu"), args)
    if rank == 0:
        (Path(out_dir) / "report.txt").write_text(text)


def test_bench_rollout_ep_size_reports_the_group_and_one_engine(tmp_path):
    run_ranks(2, bench_worker, str(tmp_path), start_method="forkserver", timeout=60.0)
    text = (tmp_path / "report.txt").read_text()
    assert "over 2 ranks" in text and "decode throughput" in text and "one engine" in text
    assert "per rank: requests [3, 2]" in text, text
