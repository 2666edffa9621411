"""Time the fused Gumbel-max sampler (moerl/kernels/triton_sampling.py) against its torch reference on a CUDA host.

    python3 scripts/gpu/kernels_check.py

One decode step's sampling at Qwen3's vocabulary ([256, 151936] logits, temperatures 1, 1, 0 and 0.6 by turns),
float32 and bf16 logits: microseconds per call of each. The correctness checks of the Triton MoE kernels and of
the sampler are tests/gpu/test_kernels_gpu.py (`make test-gpu`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a source tree, moerl not installed

import torch  # noqa: E402

from moerl.bench.common import time_fn  # noqa: E402
from moerl.rollout.sampling import SamplingBatch, SamplingParams, gumbel_argmax_reference, noise_key  # noqa: E402


def time_sampler(B: int = 256, V: int = 151_936) -> None:
    from moerl.kernels.triton_sampling import gumbel_argmax_triton  # imports triton: CUDA hosts only

    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=[1.0, 1.0, 0.0, 0.6][i % 4], seed=10_000 + i) for i in range(B)]
    batch = SamplingBatch.empty(B, "cuda")
    batch.set_rows(list(range(B)), params, [p.seed for p in params], [128 + i for i in range(B)])
    key = noise_key(batch.seed_B, batch.position_B)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (2 * torch.randn(B, V, generator=gen)).to(device="cuda", dtype=dtype)
        t_fused = time_fn(lambda: gumbel_argmax_triton(logits, batch.temperature_B, key), torch.device("cuda"))
        t_ref = time_fn(lambda: gumbel_argmax_reference(logits, batch), torch.device("cuda"))
        print(f"gumbel_argmax {dtype} [{B}, {V}]: fused {t_fused * 1e6:.0f} us, torch reference {t_ref * 1e6:.0f} us")


def main() -> int:
    assert torch.cuda.is_available(), "needs a CUDA device"
    time_sampler()
    return 0


if __name__ == "__main__":
    sys.exit(main())
