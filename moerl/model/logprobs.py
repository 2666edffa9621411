"""Log-probs (and entropy) of target tokens straight from final hidden states, chunk by chunk over tokens.

Shape legend: N token positions, D hidden size, V vocabulary, C tokens in one chunk.

The naive way (logits [N, V], fp32 log_softmax, gather) holds several N x V tensors: hundreds of GB at
V = 151,936. Here a custom autograd Function computes them a chunk of C tokens at a time, saving only the
inputs and O(N) statistics for backward and recomputing each chunk's logits there (prime-rl's chunked
log-probs, verl's fused linear cross-entropy).

Maths, per token with hidden h, target t and temperature tau (z in fp32, or fp64 for fp64 inputs):

    l = h W^T (input dtype: bf16 on tensor cores),  z = l / tau,  lse = log sum_j exp(z_j)
    log p_j = z_j - lse,   logp = log p_t,   H = -sum_j p_j log p_j   (= lse - sum_j p_j z_j)

With upstream grads g (of logp) and e (of H), and dp_i/dz_j = p_i ([i=j] - p_j), sum_i p_i = 1:

    d logp / dz_j = [j = t] - p_j
    dH / dz_j     = -sum_i (log p_i + 1) p_i ([i=j] - p_j) = -p_j (log p_j + H)
    grad_z = -g (p - onehot(t)) - e p (log p + H);   grad_l = grad_z / tau
    grad_h = grad_l W   (per chunk),   grad_W = sum over chunks of grad_l^T h   (fp32, fixed order)

Forward, per chunk: y = z - max z (<= 0), S = sum exp(y), lse = max z + log S, logp = y_t - log S and
H = log S - sum(exp(y) y) / S (two terms >= 0: no cancellation, unlike lse - sum p z). The first pass over C x V
reads the GEMM's bf16 output and writes fp32 (type promotion, no separate upcast) and the backward's last pass
writes grad_l straight in the GEMM dtype: at V = 151,936 these passes, not the GEMMs, are most of the time.

On CUDA (bf16, fp16 or fp32 inputs, with triton) those passes are two Triton kernels instead
(moerl/kernels/triton_logprobs.py): forward, one online max / sum pass over each chunk's logits for logp, lse and
H; backward, one pass writing grad_l over the recomputed logits. The GEMMs stay cuBLAS's and grad_W still
accumulates in fp32. The torch code below is the reference and the path of CPU and fp64 inputs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["chunked_token_logprobs", "default_chunk_tokens", "token_logprobs_reference"]

_CHUNK_ELEMS = 2**26  # elements of one chunk's fp32 logits: 256 MiB
# The fused path's chunk: its only C x V tensor is the GEMM's output (bf16: 1,766 tokens at V = 151,936), which
# the kernels read in place; the torch path holds ~2.5x its 256 MiB of fp32 logits in temporaries. Larger chunks
# mean larger GEMMs and fewer of the grad_W accumulations, each of which reads and writes the whole fp32 [V, D].
_FUSED_CHUNK_BYTES = 2**29  # 512 MiB


def token_logprobs_reference(hidden_ND: Tensor, weight_VD: Tensor, target_N: Tensor, with_entropy: bool,
                             temperature: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """The computation `chunked_token_logprobs` replaces, for checks and timings: full [N, V] logits, log_softmax in
    float32 (float64 for float64 inputs) over all of them, gather (and the entropy)."""
    logp_NV = torch.log_softmax((hidden_ND @ weight_VD.T).to(torch.promote_types(hidden_ND.dtype, torch.float32))
                                / temperature, dim=-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1) if with_entropy else None
    return logp_NV.gather(1, target_N[:, None]).squeeze(1), entropy_N


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk such that one chunk's fp32 logits take about 256 MiB."""
    return max(1, _CHUNK_ELEMS // vocab)


def _fused_chunk_tokens(vocab: int, dtype: torch.dtype) -> int:
    return max(1, _FUSED_CHUNK_BYTES // (vocab * dtype.itemsize))


def _fused_applies(hidden_ND: Tensor) -> bool:
    from moerl.kernels import use_triton

    return use_triton(hidden_ND)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16/fp32 logits are reduced in fp32; fp64 inputs stay fp64 (exact references, gradcheck)
    return torch.float64 if dtype == torch.float64 else torch.float32


def _shift(logits_CV: Tensor, shift_C: Tensor, temperature: float) -> Tensor:
    """(logits - shift) / tau in fp32 (fp64 for fp64 inputs). The subtraction reads the GEMM's bf16 output once
    and writes fp32 by type promotion: no separate upcast pass over C x V."""
    y_CV = torch.sub(logits_CV, shift_C[:, None])
    return y_CV.div_(temperature) if temperature != 1.0 else y_CV


def _scale_rows(x_CV: Tensor, s_C: Tensor, dtype: torch.dtype) -> Tensor:
    """x * s[:, None] written straight in dtype: one pass, no separate downcast."""
    if x_CV.dtype == dtype:
        return x_CV.mul_(s_C[:, None])
    return torch.mul(x_CV, s_C[:, None], out=torch.empty(x_CV.shape, dtype=dtype, device=x_CV.device))


def _accumulate_mm(acc_VD: Tensor, a_VC: Tensor, b_CD: Tensor) -> None:
    """acc += a @ b with the sum kept in acc's dtype, deterministically (plain GEMMs, no atomics)."""
    if a_VC.dtype == acc_VD.dtype:
        acc_VD.addmm_(a_VC, b_CD)
    elif acc_VD.is_cuda:
        # bf16 GEMM on tensor cores writing fp32 straight into the accumulator: no bf16 rounding per chunk
        torch.addmm(acc_VD, a_VC, b_CD, out_dtype=acc_VD.dtype, out=acc_VD)
    else:  # the CPU has no bf16 -> fp32 GEMM: upcast the operands (exact, and CPU bf16 GEMMs are slow anyway)
        acc_VD.addmm_(a_VC.to(acc_VD.dtype), b_CD.to(acc_VD.dtype))


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND: Tensor, weight_VD: Tensor, target_N: Tensor, with_entropy: bool,  # type: ignore[override]
                chunk: int, temperature: float, fused: bool) -> tuple[Tensor, Tensor]:
        N = hidden_ND.shape[0]
        stat = _stat_dtype(hidden_ND.dtype)
        logp_N = hidden_ND.new_empty(N, dtype=stat)
        lse_N = hidden_ND.new_empty(N, dtype=stat)
        entropy_N = hidden_ND.new_empty(N if with_entropy else 0, dtype=stat)
        with torch.autocast(hidden_ND.device.type, enabled=False):  # compute in the inputs' dtype, as documented
            if fused:
                _fused_forward(hidden_ND, weight_VD, target_N, chunk, temperature, logp_N, lse_N,
                               entropy_N if with_entropy else None)
            else:
                for lo in range(0, N, chunk):
                    hi = min(lo + chunk, N)
                    logits_CV = hidden_ND[lo:hi] @ weight_VD.T
                    max_C = logits_CV.amax(-1).to(stat)  # tau > 0: the max of l is that of l / tau; exact in fp32
                    y_CV = _shift(logits_CV, max_C, temperature)  # y = z - max z <= 0
                    del logits_CV
                    y_C = y_CV.gather(1, target_N[lo:hi, None]).squeeze(1)
                    if with_entropy:
                        # p = e^y / S, so H = log S - sum(e^y y) / S: two terms >= 0, no cancellation
                        exp_CV = y_CV.exp()
                        sum_C = exp_CV.sum(-1)
                        entropy_N[lo:hi] = sum_C.log() - exp_CV.mul_(y_CV).sum(-1) / sum_C
                        del exp_CV
                    else:
                        sum_C = y_CV.exp_().sum(-1)
                    log_sum_C = sum_C.log()
                    lse_N[lo:hi] = max_C / temperature + log_sum_C
                    logp_N[lo:hi] = y_C - log_sum_C
        ctx.save_for_backward(hidden_ND, weight_VD, target_N, lse_N, entropy_N)
        ctx.chunk, ctx.temperature, ctx.fused = chunk, temperature, fused
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_N)
        ctx.set_materialize_grads(False)  # an unused output's grad arrives as None: skip its term
        return logp_N, entropy_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp_N: Tensor | None, g_ent_N: Tensor | None):  # type: ignore[override]
        hidden_ND, weight_VD, target_N, lse_N, entropy_N = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if entropy_N.numel() == 0:
            g_ent_N = None
        if not (need_hidden or need_weight) or (g_logp_N is None and g_ent_N is None):
            return None, None, None, None, None, None, None
        N, chunk, tau, dtype = hidden_ND.shape[0], ctx.chunk, ctx.temperature, hidden_ND.dtype
        # fold -1/tau into the per-token scalars: grad_l = grad_z / tau costs no pass over C x V
        neg_g_N = g_logp_N * (-1.0 / tau) if g_logp_N is not None else None
        neg_e_N = g_ent_N * (-1.0 / tau) if g_ent_N is not None else None
        shift_N = lse_N * tau  # (l - tau lse) / tau = z - lse = log p
        grad_hidden_ND = torch.empty_like(hidden_ND) if need_hidden else None
        acc_VD = torch.zeros(weight_VD.shape, dtype=_stat_dtype(weight_VD.dtype),
                             device=weight_VD.device) if need_weight else None
        with torch.autocast(hidden_ND.device.type, enabled=False):
            if ctx.fused:
                _fused_backward(hidden_ND, weight_VD, target_N, shift_N, entropy_N, neg_g_N, neg_e_N, chunk, tau,
                                grad_hidden_ND, acc_VD)
            else:
                for lo in range(0, N, chunk):
                    hi = min(lo + chunk, N)
                    logp_CV = _shift(hidden_ND[lo:hi] @ weight_VD.T, shift_N[lo:hi], tau)
                    # p - onehot(t): a plain (non-accumulating) index_put, one index per row: deterministic, and
                    # exact where p_t is near 1
                    rows_C, tgt_C = torch.arange(hi - lo, device=logp_CV.device), target_N[lo:hi]
                    if neg_e_N is not None:
                        p_CV = logp_CV.exp()
                        # -e p (log p + H), written over log p
                        grad_CV = logp_CV.add_(entropy_N[lo:hi, None]).mul_(p_CV).mul_(neg_e_N[lo:hi, None])
                        if neg_g_N is not None:
                            p_CV[rows_C, tgt_C] -= 1
                            grad_CV.addcmul_(p_CV, neg_g_N[lo:hi, None])  # -g (p - onehot)
                        del p_CV
                        grad_CV = grad_CV.to(dtype)
                    else:
                        p_CV = logp_CV.exp_()
                        p_CV[rows_C, tgt_C] -= 1
                        grad_CV = _scale_rows(p_CV, neg_g_N[lo:hi], dtype)  # type: ignore[index]
                        del p_CV
                    # the GEMMs run in the compute dtype (tensor cores), accumulating in fp32 inside
                    if grad_hidden_ND is not None:
                        torch.mm(grad_CV, weight_VD, out=grad_hidden_ND[lo:hi])
                    if acc_VD is not None:
                        _accumulate_mm(acc_VD, grad_CV.T, hidden_ND[lo:hi])
        grad_weight_VD = acc_VD.to(weight_VD.dtype) if acc_VD is not None else None
        return grad_hidden_ND, grad_weight_VD, None, None, None, None, None


def _chunk_buffer(hidden_ND: Tensor, weight_VD: Tensor, chunk: int) -> Tensor:
    """Flat storage for one chunk's logits in the compute dtype, reused by every chunk."""
    return hidden_ND.new_empty(min(chunk, hidden_ND.shape[0]) * weight_VD.shape[0])


def _chunk_logits(buf: Tensor, hidden_CD: Tensor, weight_VD: Tensor) -> Tensor:
    C, V = hidden_CD.shape[0], weight_VD.shape[0]
    return torch.mm(hidden_CD, weight_VD.T, out=buf[: C * V].view(C, V))


def _fused_forward(hidden_ND: Tensor, weight_VD: Tensor, target_N: Tensor, chunk: int, tau: float, logp_N: Tensor,
                   lse_N: Tensor, entropy_N: Tensor | None) -> None:
    """The forward's chunk loop on the Triton stats kernel: one pass over each chunk's GEMM output."""
    from moerl.kernels.triton_logprobs import logprob_stats

    N, buf = hidden_ND.shape[0], _chunk_buffer(hidden_ND, weight_VD, chunk)
    for lo in range(0, N, chunk):
        hi = min(lo + chunk, N)
        logprob_stats(_chunk_logits(buf, hidden_ND[lo:hi], weight_VD), target_N[lo:hi], tau, logp_N[lo:hi],
                      lse_N[lo:hi], entropy_N[lo:hi] if entropy_N is not None else None)


def _fused_backward(hidden_ND: Tensor, weight_VD: Tensor, target_N: Tensor, shift_N: Tensor, entropy_N: Tensor,
                    neg_g_N: Tensor | None, neg_e_N: Tensor | None, chunk: int, tau: float,
                    grad_hidden_ND: Tensor | None, acc_VD: Tensor | None) -> None:
    """The backward's chunk loop: recompute the logits, the Triton kernel overwrites them with grad_l (compute
    dtype), and the two GEMMs read it as the torch path's grad_CV."""
    from moerl.kernels.triton_logprobs import logprob_grad_

    N, buf = hidden_ND.shape[0], _chunk_buffer(hidden_ND, weight_VD, chunk)
    for lo in range(0, N, chunk):
        hi = min(lo + chunk, N)
        grad_CV = logprob_grad_(_chunk_logits(buf, hidden_ND[lo:hi], weight_VD), target_N[lo:hi], shift_N[lo:hi],
                                tau, entropy_N[lo:hi] if neg_e_N is not None else None,
                                neg_g_N[lo:hi] if neg_g_N is not None else None,
                                neg_e_N[lo:hi] if neg_e_N is not None else None)
        if grad_hidden_ND is not None:
            torch.mm(grad_CV, weight_VD, out=grad_hidden_ND[lo:hi])
        if acc_VD is not None:
            _accumulate_mm(acc_VD, grad_CV.T, hidden_ND[lo:hi])


def _is_dtensor(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def _check_inputs(hidden: Tensor, weight_VD: Tensor, target: Tensor, chunk_tokens: int | None,
                  temperature: float) -> None:
    if _is_dtensor(hidden) or _is_dtensor(weight_VD):
        raise ValueError("pass plain tensors: call this inside the FSDP-sharded module's forward, where its weight "
                         "is unsharded, or pass weight.full_tensor()")
    if weight_VD.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight_VD.shape[1]:
        raise ValueError(f"need hidden [..., D] and weight [V, D], got {tuple(hidden.shape)} and "
                         f"{tuple(weight_VD.shape)}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if not hidden.is_floating_point() or hidden.dtype != weight_VD.dtype:
        raise ValueError(f"hidden and weight need one floating dtype, got {hidden.dtype} and {weight_VD.dtype}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"target must hold integer token ids, got {target.dtype}")
    if not (hidden.device == weight_VD.device == target.device):
        raise ValueError(f"hidden, weight and target on different devices: {hidden.device}, "
                         f"{weight_VD.device}, {target.device}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    V = weight_VD.shape[0]
    if target.numel() and target.is_cuda:  # no host sync: a device-side assert, which ends the CUDA context
        tmin, tmax = target.detach().aminmax()
        torch._assert_async((tmin >= 0) & (tmax < V), f"target ids must lie in [0, {V}) (the vocabulary)")
    elif target.numel():
        tmin, tmax = torch.stack(list(target.detach().aminmax())).tolist()
        if tmin < 0 or tmax >= V:
            raise ValueError(f"target ids must lie in [0, {V}) (the vocabulary); got min {tmin}, max {tmax}. "
                             "Put 0 at padding positions and mask them out of the loss")


def chunked_token_logprobs(hidden_ND: Tensor, weight_VD: Tensor, target_N: Tensor, *, with_entropy: bool = False,
                           chunk_tokens: int | None = None, temperature: float = 1.0,
                           fused: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """fp32 log-probs [N] of the targets, and the policy entropy [N] when asked; differentiable in hidden and weight.

    logits = hidden @ weight.T / temperature (no bias). hidden may be [..., D] with target [...] (e.g. [B, T, D]
    and [B, T]); the outputs then have target's shape. hidden and weight share one dtype (bf16, fp16, fp32 or
    fp64): the matmuls run in it, the softmax statistics in fp32 (fp64 for fp64 inputs, whose outputs are fp64).
    Autocast is ignored: cast before calling. chunk_tokens (default: about 256 MiB of fp32 logits per chunk, or
    512 MiB of the compute dtype's on the fused path) trades memory for GEMM size; the result does not depend on
    it beyond float rounding. Every target must lie in [0, V): padding positions are the caller's to fill and
    mask (a ValueError on the CPU; on CUDA a device-side assert, so that the check costs no host sync).
    fused: None takes the Triton kernels where they apply (CUDA, triton, bf16/fp16/fp32), False the torch path
    (the reference, for checks and benchmarks), True the kernels anywhere triton imports (CPU tensors under
    TRITON_INTERPRET=1: the CPU's check of the kernels).
    """
    _check_inputs(hidden_ND, weight_VD, target_N, chunk_tokens, temperature)
    fused = _fused_applies(hidden_ND) if fused is None else fused
    if fused and hidden_ND.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the fused path takes bf16, fp16 or fp32 inputs, got {hidden_ND.dtype}")
    out_shape = target_N.shape
    flat_ND = hidden_ND.reshape(-1, hidden_ND.shape[-1])
    flat_N = target_N.reshape(-1).long()
    N, V = flat_ND.shape[0], weight_VD.shape[0]
    if chunk_tokens is None:
        chunk_tokens = _fused_chunk_tokens(V, hidden_ND.dtype) if fused else default_chunk_tokens(V)
    chunk = max(1, min(chunk_tokens, N))
    logp_N, entropy_N = _ChunkedLogprobs.apply(flat_ND, weight_VD, flat_N.contiguous() if fused else flat_N,
                                               with_entropy, chunk, float(temperature), bool(fused))
    return logp_N.reshape(out_shape), entropy_N.reshape(out_shape) if with_entropy else None
