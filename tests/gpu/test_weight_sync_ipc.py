"""Weight sync over CUDA IPC, without Ray: a trainer publishes its bf16 weights into its two slots of bucket
buffers, a rollout engine in another process maps them and copies them in. After every version (both slots,
each several times) the engine's weights must equal the trainer's bf16 cast bitwise.

The buckets are carved out of one cached allocator segment on purpose (a freed block large enough for all of
them stays cached, as memory freed by training does): they then share the segment's IPC memory handle at
different offsets, the case where a worker keyed by the handle alone read every other version from another
bucket's bytes. The test asserts that the case really occurs. On the CPU smoke run the same path runs over
/dev/shm files. The time a version takes (publish to applied, decode paused) is `moerl bench loop`'s weight sync
line, measured in the loop.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from moerl.model import MoEModelConfig, build_model
from moerl.train.config import LossConfig, OptimConfig
from moerl.train.trainer import PolicyTrainer

VERSIONS = 5
BUCKET_BYTES = 8 << 20  # under the allocator's 10 MB "large" cut: several buckets per segment either way


def arch_for(device_type: str) -> MoEModelConfig:
    if device_type == "cuda":
        return MoEModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=32,
                              num_experts_per_tok=4, moe_intermediate_size=256)
    return MoEModelConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=16)


def checksums(named) -> dict[str, int]:
    """Per tensor, a position-weighted sum of its bytes: equal iff the bits are (for these purposes), and
    computed on any device with integer arithmetic only."""
    out = {}
    for name, t in named:
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
        out[name] = int(b.mul_(torch.arange(b.numel(), device=b.device) % 251 + 1).sum())
    return out


def engine_process(device_type: str, inbox, outbox) -> None:
    """The rollout side: an engine on its own weights, updated from each version's shared handles."""
    from moerl.actors.weight_sync import Receiver, apply_weights
    from moerl.rollout import Engine, EngineConfig

    device = torch.device(device_type)
    engine = Engine(build_model(arch_for(device_type), dtype=torch.bfloat16, device=device, seed=1),
                    EngineConfig(max_batch_size=4, max_seq_len=64, gpu_memory_fraction=0.2))
    receiver = Receiver(engine.device)
    while (msg := inbox.get(timeout=300)) is not None:
        version, handles = msg
        apply_weights(engine, receiver.receive(handles), version)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        state = engine.model.state_dict()
        outbox.put((engine.version, checksums((e.name, state[e.name]) for h in handles for e in h.layout.entries)))
    outbox.put(None)


def test_cuda_ipc_weight_sync_is_bitwise_through_both_slots(device, report):
    from moerl.actors.weight_sync.publisher import Publisher

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=engine_process, args=(device.type, inbox, outbox), daemon=True)
    child.start()
    try:
        trainer = PolicyTrainer(build_model(arch_for(device.type), dtype=torch.float32, device=device, seed=0),
                                OptimConfig(lr=1e-3), LossConfig(), compute_dtype=torch.bfloat16)
        publisher = Publisher(trainer, expert_parallel=False, bucket_bytes=BUCKET_BYTES)
        total = sum(layout.nbytes for layout in publisher.layouts)
        if device.type == "cuda":  # a cached free block that holds both slots: the buckets are carved from it
            del_me = torch.empty(2 * total + (64 << 20), dtype=torch.uint8, device=device)
            del del_me
        gen = torch.Generator(device=device).manual_seed(0)
        all_handles = []
        for version in range(1, VERSIONS + 1):
            with torch.no_grad():  # a new version: every weight moves
                for p in trainer.model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen, device=device), alpha=1e-2)
            handles = publisher.shared(version)
            all_handles.append(handles)
            want = checksums(trainer.publish_state().items())
            inbox.put((version, handles))
            got_version, got = outbox.get(timeout=300)
            assert got_version == version
            assert sorted(got) == sorted(want)
            wrong = [name for name in want if got[name] != want[name]]
            assert not wrong, f"version {version} (slot {version % 2}): {len(wrong)} tensors differ, e.g. {wrong[:3]}"
        inbox.put(None)
        assert outbox.get(timeout=120) is None
        if device.type == "cuda":
            slot_handles = [h.cuda_ipc for h in all_handles[0] + all_handles[1]]
            by_handle = {ipc[7] for ipc in slot_handles}
            assert len(by_handle) < len(slot_handles), "every bucket had its own segment: the shared-handle case did not occur"
            report(f"weight sync (CUDA IPC): {len(slot_handles)} buckets of 2 slots in {len(by_handle)} segments; "
                   f"{VERSIONS} versions of {total / 1e6:.0f} MB bitwise equal")
        publisher.close()
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
