"""Where a rollout engine's time goes at the `moerl bench loop` GPU shape: prefill vs decode vs host work per
step (device-synchronised timers around each part), the decode batch occupancy, and the same engine on
fixed-length requests (no EOS) for comparison.

    python scripts/gpu/engine_profile.py [--requests 512] [--preset medium]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="medium")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    args = p.parse_args()

    from moerl.config import load_config
    from moerl.model import build_model
    from moerl.rollout import Engine
    from moerl.run import _specs, model_architecture
    from moerl.tasks.base import load_task

    cfg = load_config("configs/demo.toml", [f"--model.preset={args.preset}", "--model.dtype=bfloat16",
                                            "--run.device=" + ("cuda" if torch.cuda.is_available() else "cpu"), f"--rollout.max_new_tokens={args.new_tokens}",
                                            f"--rollout.max_seq_len={args.new_tokens + 64}",
                                            f"--rollout.max_batch_size={args.batch}"])
    task = load_task(cfg.task.name, dict(cfg.task.options), seed=0)
    arch = model_architecture(cfg, task)
    spec, _ = _specs(cfg, arch, task)
    model = build_model(arch, dtype=torch.bfloat16, device=spec.device, seed=0)
    G = cfg.rollout.group_size
    prompts = [task.prompt_at(i // G).prompt_token_ids for i in range(args.requests)]

    for label, stop in (("EOS stops", True), ("fixed length", False)):
        engine = Engine(model, dataclasses.replace(spec.engine))
        timers: dict[str, float] = collections.defaultdict(float)
        counts: dict[str, int] = collections.defaultdict(int)
        for name in ("_admit", "_prefill", "_decode"):
            inner = getattr(engine, name)

            def timed(*a, _inner=inner, _name=name, **kw):
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                t0 = time.perf_counter()
                out = _inner(*a, **kw)
                torch.cuda.synchronize() if torch.cuda.is_available() else None
                timers[_name] += time.perf_counter() - t0
                counts[_name] += 1
                return out
            setattr(engine, name, timed)
        params = [dataclasses.replace(spec.sampling, seed=i, stop_token_ids=spec.sampling.stop_token_ids if stop
                                      else []) for i in range(args.requests)]
        engine.generate(prompts[: args.batch], params[: args.batch])  # warm-up: graphs, kernels
        timers.clear(), counts.clear()
        engine.stats.update({k: 0 for k in engine.stats})
        t0 = time.perf_counter()
        done = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for c in done)
        st = dict(engine.stats)
        print(f"[{label}] {args.requests} requests, {tokens} tokens in {wall:.2f} s: {tokens / wall:.0f} tok/s, "
              f"{args.requests / wall:.1f} samples/s; mean length {tokens / args.requests:.0f}", flush=True)
        for name in timers:
            print(f"   {name:9} {timers[name]:7.2f} s in {counts[name]:5d} calls "
                  f"({1e3 * timers[name] / max(counts[name], 1):.2f} ms each)", flush=True)
        print(f"   other (host) {wall - sum(timers.values()):.2f} s; stats {st}; decode rows per step "
              f"{st.get('decode_tokens', 0) / max(st.get('decode_steps', 1), 1):.0f}", flush=True)


if __name__ == "__main__":
    main()
