"""A short `moerl train` on one GPU at the 1.65B bf16 shape: trainer rank and rollout worker share the GPU,
weights travel over CUDA IPC (transport auto), sync mode. In sync mode every sample is drawn by the very
weights the trainer starts its step from, so behaviour KL measures only engine/trainer numerics: it must stay
under the bound on every step. (With the shared buffers keyed by their IPC handle alone, every other step read
~10 nats per token.) Needs Ray: `make test-gpu` installs it from the carried .whl/.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.cuda_only

KL_BOUND = 5e-3  # per token, every step; numerics alone measured ~1e-4 at this shape
STEPS = 6


def test_moerl_train_on_the_gpu_keeps_behaviour_kl_under_the_bound(tmp_path, report):
    pytest.importorskip("ray", reason="Ray is not installed here: carry .whl (../shared/tools/device-wheels.sh)")
    from moerl.config import load_config
    from moerl.run import train

    run_dir = tmp_path / "run"
    cfg = load_config("configs/demo.toml", [
        "--run.device=cuda", "--model.dtype=bfloat16", "--model.preset=medium", f"--run.dir={run_dir}",
        "--train.mode=sync", f"--train.steps={STEPS}", "--train.sft_steps=10", "--train.sft_lr=3e-4",
        "--train.optim.lr=1e-5", "--train.batch_groups=16", "--rollout.num_workers=1",
        "--rollout.gpus_per_worker=0.45", "--train.gpus_per_rank=0.45", "--rollout.max_inflight_groups=16",
        "--ray.num_cpus=8", "--weights.bucket_mb=64"])
    train(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = [r for r in rows if r.get("step", 0) > 0 and "is/behaviour_kl" in r]
    kl = [round(r["is/behaviour_kl"], 6) for r in rl]
    report(f"moerl train (1.65B bf16, sync, CUDA IPC): behaviour KL per step {kl}, "
           f"{sum(r.get('samples', 0) for r in rl)} samples, last reward {rl[-1].get('reward/mean', 0):.3f}")
    assert len(rl) == STEPS and all(r.get("samples", 0) > 0 for r in rl)
    assert max(kl) <= KL_BOUND, f"behaviour KL {kl}"
    assert all(r.get("is/weight_max", 1.0) < 2.0 for r in rl), [r.get("is/weight_max") for r in rl]
