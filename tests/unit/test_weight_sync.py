"""Weight sync's CPU path without Ray: buckets of one flat buffer round-trip every tensor bitwise (any dtype,
odd sizes, expert offsets), and trainer -> bucket -> engine leaves the engine's weights equal to the trainer's."""

from __future__ import annotations

import pickle

import torch

from moerl.actors.weight_sync import apply_weights, pack_bucket, stage, unpack_bucket
from moerl.model import build_model, tiny_config
from moerl.rollout import Engine, EngineConfig
from moerl.train.config import LossConfig, OptimConfig
from moerl.train.trainer import PolicyTrainer, Sample


def test_bucket_round_trip_is_bitwise_for_every_dtype_and_shape():
    g = torch.Generator().manual_seed(0)
    items = [("a", torch.randn(3, 5, generator=g), None), ("b", torch.randn(7, generator=g).to(torch.bfloat16), 4),
             ("c", torch.randint(0, 9, (2, 3, 1), generator=g, dtype=torch.int16), None),
             ("d", torch.randn(1, generator=g, dtype=torch.float64), None), ("e", torch.zeros(0, 3), None)]
    bucket = pickle.loads(pickle.dumps(pack_bucket(items)))  # what crossing a process boundary does to it
    back = unpack_bucket(bucket)
    assert [(n, o) for n, _, o in back] == [(n, o) for n, _, o in items]
    for (_, want, _), (_, got, _) in zip(items, back):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert all(e.start % 64 == 0 for e in bucket.layout.entries)


def test_engine_weights_equal_the_trainers_after_every_sync():
    arch = tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8)
    trainer = PolicyTrainer(build_model(arch, seed=0), OptimConfig(lr=1e-2), LossConfig())
    engine = Engine(build_model(arch, seed=1), EngineConfig(max_batch_size=2, max_seq_len=32), version=0)
    g = torch.Generator().manual_seed(0)
    for version in (1, 2, 3):
        batch = [Sample(torch.randint(0, 64, (4,), generator=g).tolist(), torch.randint(0, 64, (3,), generator=g).tolist(),
                        [-1.0] * 3, 1.0 - 2 * (i % 2)) for i in range(4)]
        trainer.rl_step(batch)
        published = list(trainer.publish_state().items())
        buckets = [pack_bucket([(n, t, None) for n, t in published[i: i + 5]]) for i in range(0, len(published), 5)]
        apply_weights(engine, stage([x for b in buckets for x in unpack_bucket(b)], engine.device), version)
        want, got = trainer.model.state_dict(), engine.model.state_dict()
        assert engine.version == version and sorted(want) == sorted(got)
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_shared_opener_keeps_buffers_of_one_cuda_segment_apart(monkeypatch):
    """Two bucket buffers that the caching allocator carved out of one CUDA segment share its IPC memory handle
    at different storage offsets: each must map to its own buffer (keyed by the handle alone, the second was
    read from the first's bytes, and the engine decoded with wrong weights on every other version)."""
    from moerl.actors.weight_sync.buckets import plan
    from moerl.actors.weight_sync.shared import Location, SharedBucket, SharedOpener

    layout = plan([("w", torch.bfloat16, (512, 1024), None)], 1 << 20)[0]

    def ipc(offset_bytes: int) -> tuple:  # rebuild_cuda_tensor's arguments as reduce_tensor gives them
        return (torch.Tensor, (layout.nbytes,), (1,), 0, torch.storage.UntypedStorage, torch.uint8, 0,
                b"one-segment-handle", layout.nbytes, offset_bytes, False, b"ref", 0, b"event", True)

    where = Location("node", ("GPU-0",))
    first, second = (SharedBucket(layout, where, cuda_ipc=ipc(o)) for o in (0, layout.nbytes))
    mapped = []
    monkeypatch.setattr(SharedOpener, "_map", staticmethod(lambda b: mapped.append(b) or torch.full((1,), len(mapped))))
    opener = SharedOpener()
    a, b = opener.open(first), opener.open(second)
    assert mapped == [first, second] and not torch.equal(a, b)
    assert opener.open(first) is a and opener.open(second) is b and len(mapped) == 2  # each mapped once


def test_expert_bias_travels_in_float32_and_steers_the_engines_routing():
    """model.expert_bias_update_rate: the trainer's router bias reaches the engine with the weights, exactly, and
    the engine a worker builds chooses experts with it (a +100 bias once left the rollout's choices unchanged)."""
    from dataclasses import replace

    from moerl.actors.rollout_worker import _build_engine
    from moerl.actors.worker_spec import WorkerSpec
    from moerl.rollout import SamplingParams

    arch = tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8)
    trainer = PolicyTrainer(build_model(arch, seed=0), OptimConfig(lr=1e-2), LossConfig(), expert_bias_rate=1e-3,
                            compute_dtype=torch.bfloat16)
    for block in trainer.model.moe_blocks:
        block.gate.expert_bias[3] = 100.0 + 1e-3  # +1e-3 is below bf16's resolution at 100: it must survive
    spec = WorkerSpec(arch=arch.to_hf_dict(), model_path="", dtype="float32", device="cpu",
                      engine=EngineConfig(max_batch_size=2, max_seq_len=32), sampling=SamplingParams(),
                      task_name="", task_options={}, seed=1, expert_bias=True)
    published = trainer.publish_state()
    bias_names = [n for n in published if n.endswith("expert_bias")]
    assert bias_names and all(published[n].dtype == torch.float32 for n in bias_names)
    assert all(published[n][3] == 100.0 + 1e-3 for n in bias_names)
    for expert_bias, must_pick in ((True, True), (False, False)):
        engine = _build_engine(replace(spec, expert_bias=expert_bias), arch, torch.float32)
        apply_weights(engine, stage([(n, t, None) for n, t in published.items()], engine.device), 1)
        (c,) = engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=4, temperature=0.0))
        picks_3 = bool((c.routed_experts == 3).any(-1).all())
        assert picks_3 == must_pick  # with the bias on, expert 3 at every position and layer
