"""Same-GPU weight sync over CUDA IPC, without Ray: a trainer process publishes its bf16 weights into bucket
buffers, a rollout engine in another process maps them and copies them in. Checks the engine's weights equal the
trainer's published ones (per-tensor checksums of the bits) and times each part:

    publish   the trainer's gather + cast into the bucket buffers (what a training step waits for)
    open      mapping the IPC handles (first version only; they are cached after)
    apply     the engine's copy from the mapped buffers (decode paused)
    host      for comparison, the same publish into pinned host memory (the object-store form, before ray.put)

    python scripts/gpu/weight_sync_check.py [--preset medium] [--versions 4]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.multiprocessing as mp


def _arch(preset: str):
    from moerl.config import load_config
    from moerl.run import model_architecture
    from moerl.tasks.base import load_task

    cfg = load_config("configs/demo.toml", [f"--model.preset={preset}", "--model.dtype=bfloat16"])
    return model_architecture(cfg, load_task(cfg.task.name, dict(cfg.task.options), seed=0))


def _checksums(named) -> dict[str, int]:
    return {name: int(t.contiguous().reshape(-1).view(torch.uint8).to(torch.int64).mul_(
        torch.arange(t.numel() * t.element_size(), device=t.device) % 251 + 1).sum()) for name, t in named}


def engine_process(preset: str, device: str, inbox, outbox) -> None:
    from moerl.actors.weight_sync import Receiver, apply_weights
    from moerl.model import build_model
    from moerl.rollout import Engine, EngineConfig

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    engine = Engine(build_model(_arch(preset), dtype=torch.bfloat16, device=device, seed=1),
                    EngineConfig(max_batch_size=8, max_seq_len=64))
    receiver = Receiver(engine.device)
    while (msg := inbox.get(timeout=600)) is not None:
        version, handles = msg
        t0 = time.perf_counter()
        tensors = receiver.receive(handles)
        sync()
        t1 = time.perf_counter()
        apply_weights(engine, tensors, version)
        sync()
        t2 = time.perf_counter()
        state = engine.model.state_dict()
        outbox.put((version, t1 - t0, t2 - t1, _checksums((name, state[name]) for name, _, _ in tensors)))
    outbox.put(None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="medium")
    p.add_argument("--versions", type=int, default=4)
    p.add_argument("--device", default="cuda", help="cpu: the /dev/shm twin (a quick check of the script)")
    args = p.parse_args()

    from moerl.actors.weight_sync.publisher import Publisher
    from moerl.model import build_model
    from moerl.train.config import LossConfig, OptimConfig
    from moerl.train.trainer import PolicyTrainer

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=engine_process, args=(args.preset, args.device, inbox, outbox), daemon=True)
    child.start()
    trainer = PolicyTrainer(build_model(_arch(args.preset), dtype=torch.float32, device=args.device, seed=0),
                            OptimConfig(lr=1e-3), LossConfig(), compute_dtype=torch.bfloat16)
    publisher = Publisher(trainer, expert_parallel=False, bucket_bytes=256 << 20)
    total = sum(layout.nbytes for layout in publisher.layouts)
    print(f"{args.preset}: {total / 1e9:.2f} GB published in {len(publisher.layouts)} buckets", flush=True)
    ok = True
    for version in range(1, args.versions + 1):
        with torch.no_grad():  # a new version: nudge every weight
            for p_ in trainer.model.parameters():
                p_.add_(1e-3 * version)
        t0 = time.perf_counter()
        handles = publisher.shared(version)
        publish_s = time.perf_counter() - t0
        want = _checksums((name, t.to(trainer.publish_dtype(name, t))) for name, t in trainer.publish_items())
        inbox.put((version, handles))
        got_version, open_s, apply_s, got = outbox.get(timeout=600)
        same = got == want
        ok &= same
        print(f"version {got_version}: publish {1e3 * publish_s:.1f} ms, open {1e3 * open_s:.1f} ms, apply "
              f"{1e3 * apply_s:.1f} ms ({total / apply_s / 1e9:.0f} GB/s), publish->applied "
              f"{1e3 * (publish_s + open_s + apply_s):.1f} ms, bitwise equal: {same}", flush=True)
    host = [torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=args.device == "cuda") for layout in publisher.layouts]
    t0 = time.perf_counter()
    publisher.fill(host)
    print(f"for comparison, publish into pinned host memory: {1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    inbox.put(None)
    outbox.get(timeout=60)
    child.join(timeout=60)
    publisher.close()
    print("OK" if ok else "MISMATCH")


if __name__ == "__main__":
    main()
