"""AsyncEngine: concurrent streams, abort between steps, weight updates between steps."""

import asyncio

import torch

from moerl.model import build_model, tiny_config
from moerl.rollout import AsyncEngine, Engine, EngineConfig, SamplingParams


def _engine(**kw):
    model = build_model(tiny_config(), seed=0)
    return Engine(model, EngineConfig(max_batch_size=4, max_seq_len=64, **kw))


def test_concurrent_streams_match_batch_generate():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15, 16, 17]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    expected = _engine().generate(prompts, params)

    async def main():
        engine = AsyncEngine(_engine())

        async def one(p):
            deltas, completion = [], None
            async for out in engine.stream(p, params):
                deltas += out.new_token_ids
                completion = out.completion or completion
            return deltas, completion

        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=60)

    for (deltas, completion), exp in zip(asyncio.run(main()), expected):
        assert deltas == completion.token_ids == exp.token_ids
        assert completion.finish_reason == "length"


def test_abort_ends_stream_with_partial_completion_and_update_weights_between_steps():
    async def main():
        engine = AsyncEngine(_engine())
        params = SamplingParams(max_new_tokens=40, temperature=0.0)
        seen = []

        async def consume():
            async for out in engine.stream([1, 2, 3], params, request_id="a"):
                seen.append(out)
                if len(seen) == 3:
                    engine.update_weights({}, version=9)
                if len(seen) == 6:
                    engine.abort("a")

        await asyncio.wait_for(consume(), timeout=60)
        return seen

    seen = asyncio.run(main())
    final = seen[-1].completion
    assert final.finish_reason == "abort"
    assert 0 < len(final.token_ids) < 40
    assert final.versions[:3] == [0, 0, 0] and final.versions[-1] == 9
    assert final.routed_experts.shape[0] == 3 + len(final.token_ids) - 1
    torch.testing.assert_close(torch.tensor(final.logprobs).isfinite(), torch.ones(len(final.logprobs), dtype=torch.bool))
