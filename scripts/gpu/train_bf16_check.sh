#!/usr/bin/env bash
# A short bf16 `moerl train` on one GPU: do the float32 master weights move at lr 1e-6 (update/param_change_frac),
# and how long are the trainer's steps? (40 SFT steps first: from a random init every reward is 0, every GRPO
# advantage 0, and a zero gradient rightly moves nothing.) Run from the repo root on the GPU machine, after
# installing the wheels of ../shared/tools/device-wheels.sh (Ray):  bash scripts/gpu/train_bf16_check.sh /tmp/run
set -euo pipefail
run_dir=${1:-/tmp/moerl-bf16-check}
export RAY_AUTH_MODE=disabled PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
python3 -m moerl.cli train configs/demo.toml --run.dir="$run_dir" --run.device=cuda --model.dtype=bfloat16 \
  --model.preset=small --train.steps=${STEPS:-10} --train.sft_steps=40 --train.optim.lr=1e-6 \
  --train.micro_batch_tokens=2048 --train.activation_checkpointing=true --rollout.num_workers=1 \
  --rollout.gpus_per_worker=0.45 --train.gpus_per_rank=0.45 --ray.num_cpus=8
python3 - "$run_dir/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rl = [r for r in rows if r.get("step", 0) > 0]
for r in rl[:3] + rl[-3:]:
    print({k: round(r[k], 6) for k in ("step", "update/param_change_frac", "update/published_change_frac",
                                          "grad_norm", "reward/mean", "time/train_s") if k in r})
PY
