"""Fused kernels for the memory-bound parts of the MoE step, with torch reference implementations.

Every op here has one torch implementation (any device, any dtype, the reference) and, on CUDA with triton
installed, a Triton one. `use_triton(x)` decides per call; the torch path is what CPU tests exercise, and
tests/gpu/ (`make test-gpu`) checks the Triton path against it on a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F

_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    return _TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up on the fused [N, 2I] projection; the backward writes [N, 2I] directly (no cat)."""

    @staticmethod
    def forward(ctx, h_NF: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h_NF)
        if use_triton(h_NF):
            from moerl.kernels.triton_moe import swiglu_forward

            return swiglu_forward(h_NF)
        gate_NI, up_NI = h_NF.chunk(2, dim=-1)
        return F.silu(gate_NI) * up_NI

    @staticmethod
    def backward(ctx, grad_NI: torch.Tensor) -> torch.Tensor:
        (h_NF,) = ctx.saved_tensors
        if use_triton(h_NF):
            from moerl.kernels.triton_moe import swiglu_backward

            return swiglu_backward(h_NF, grad_NI)
        gate_NI, up_NI = h_NF.float().chunk(2, dim=-1)
        sig_NI = torch.sigmoid(gate_NI)
        grad32_NI = grad_NI.float()
        grad_gate_NI = grad32_NI * up_NI * sig_NI * (1 + gate_NI * (1 - sig_NI))
        grad_up_NI = grad32_NI * gate_NI * sig_NI
        return torch.cat([grad_gate_NI, grad_up_NI], dim=-1).to(h_NF.dtype)


def swiglu(h_NF: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate|up projection [N, 2I] -> [N, I]."""
    return _SwiGLU.apply(h_NF)


def gather_blocks(x_NGPd: torch.Tensor, table_BW: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of each row's blocks, in order, as one tensor [B, G, length, d] (a copy).

    x_NGPd: a pool of N blocks of P positions (G heads, head size d); table_BW: each row's blocks in order."""
    B, W = table_BW.shape
    _, G, P, d = x_NGPd.shape
    return x_NGPd[table_BW].transpose(1, 2).reshape(B, G, W * P, d)[:, :, :length]


def paged_decode_reference(q_BHd: torch.Tensor, k_NGPd: torch.Tensor, v_NGPd: torch.Tensor,
                           table_BW: torch.Tensor, seq_len_B: torch.Tensor) -> torch.Tensor:
    """Attention of one query position per row over its first seq_len_B[b] cached positions: [B, H, d].
    Gathers the table's blocks and runs masked SDPA (scale 1/sqrt(d), as the model's attention)."""
    S = table_BW.shape[1] * k_NGPd.shape[2]
    k_BGSd, v_BGSd = gather_blocks(k_NGPd, table_BW, S), gather_blocks(v_NGPd, table_BW, S)
    mask_B11S = (torch.arange(S, device=q_BHd.device)[None, :] < seq_len_B[:, None])[:, None, None, :]
    out_BH1d = F.scaled_dot_product_attention(q_BHd[:, :, None], k_BGSd, v_BGSd, attn_mask=mask_B11S,
                                              enable_gqa=q_BHd.shape[1] != k_NGPd.shape[1])
    return out_BH1d[:, :, 0]


def paged_decode_attention(q_BHd: torch.Tensor, k_NGPd: torch.Tensor, v_NGPd: torch.Tensor,
                           table_BW: torch.Tensor, seq_len_B: torch.Tensor) -> torch.Tensor:
    """`paged_decode_reference`, on CUDA by the Triton kernel, which reads only each row's live positions."""
    if use_triton(q_BHd):
        from moerl.kernels.triton_paged import paged_decode

        return paged_decode(q_BHd, k_NGPd, v_NGPd, table_BW, seq_len_B)
    return paged_decode_reference(q_BHd, k_NGPd, v_NGPd, table_BW, seq_len_B)


@functools.lru_cache(maxsize=None)
def paged_decode_ok(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int) -> bool:
    """Whether the Triton paged decode matches `paged_decode_reference` at this head layout (checked once per
    process and shape, eagerly: the engine asks before any decode graph is captured). A kernel that fails to
    compile or disagrees leaves decode on the gather + SDPA path, with a warning, instead of wrong attention."""
    from moerl.kernels.triton_paged import paged_decode

    g = torch.Generator(device=device).manual_seed(0)
    B, W, N = 5, 4, 24
    q_BHd = torch.randn(B, num_heads, head_dim, generator=g, device=device).to(dtype)
    k_NGPd = torch.randn(N, num_kv_heads, block_size, head_dim, generator=g, device=device).to(dtype)
    v_NGPd = torch.randn(N, num_kv_heads, block_size, head_dim, generator=g, device=device).to(dtype)
    table_BW = torch.randperm(N, generator=g, device=device)[: B * W].view(B, W)
    seq_len_B = torch.tensor([1, block_size, W * block_size, 2 * block_size + 1, 3], device=device)
    seq_len_B = seq_len_B.clamp(max=W * block_size)
    try:
        got_BHd = paged_decode(q_BHd, k_NGPd, v_NGPd, table_BW, seq_len_B).float()
        want_BHd = paged_decode_reference(q_BHd.float(), k_NGPd.float(), v_NGPd.float(), table_BW, seq_len_B)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        ok = bool(torch.allclose(got_BHd, want_BHd, atol=tol, rtol=tol))
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: the gather path still attends right
        logging.getLogger(__name__).warning("the Triton paged decode failed (%s): decode gathers blocks instead", e)
        return False
    if not ok:
        logging.getLogger(__name__).warning("the Triton paged decode disagrees with its reference (%s, %d/%d heads, "
                                            "head_dim %d): decode gathers blocks instead", dtype, num_heads,
                                            num_kv_heads, head_dim)
    return ok
