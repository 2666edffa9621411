"""Helpers shared by the GPU suite's tests (imported as `gpu_helpers`: pytest puts this folder on the path)."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 on the CPU; NaN anywhere fails every bound."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not torch.isfinite(got).all():
        return float("nan")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Non-trivial weights everywhere (norms too) with clear logit and router margins, drawn on the CPU so every
    machine gets the same model."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        p.copy_((1.0 + 0.1 * noise) if "norm" in name else (0.05 * noise if name.endswith(".bias") else std * noise))

