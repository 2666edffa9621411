"""Sampling: greedy, temperature, top-k, top-p, with noise keyed by (seed, position, token id).

Shape legend: B requests in the batch, V vocabulary, C candidates (the top-k set, or V when sorting all).

Randomness is a counter-based hash, not a torch.Generator: the Gumbel noise for request r at position p and
token v is a pure function of (seed_r, p, v). So a request's tokens do not depend on what else is in the batch,
on the order of the batch, on the device (the same integer arithmetic runs on CPU and CUDA), or on which engine
continues it after a preemption; and the whole batch samples in a few vectorised kernels (graph-capturable).

Cost: with no top-k/top-p (RL's temperature-1 decode) a token is argmax(logits / T + noise), the Gumbel-max
trick (the exponential race with E = -log U): no sort, and on CUDA one fused Triton pass over the logits that
also yields the full log-softmax of the chosen token. Top-k sorts only its top-K candidates; top-p without a
top-k on every row still sorts the whole vocabulary.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    # Any of these ends the request (finish_reason "stop"): EOS, and for chat models `<|im_end|>` etc.
    # (moerl.tasks.stop_token_ids, moerl.model.read_stop_token_ids). A list or one int is taken as a tuple.
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # None: the engine draws one per request
    min_new_tokens: int = 0  # stop tokens are ignored before this many tokens

    def __post_init__(self) -> None:
        ids = self.stop_token_ids
        self.stop_token_ids = (ids,) if isinstance(ids, int) else tuple(ids)

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the bad field."""
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0 or self.temperature != self.temperature:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.min_new_tokens < 0:
            raise ValueError(f"SamplingParams.min_new_tokens must be >= 0, got {self.min_new_tokens}")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding values < 2**32.

    Multipliers are below 2**31 so every product fits in int64: no overflow, identical on every device. The
    Triton sampler (moerl/kernels/triton_sampling.py) computes the same bits in uint32 arithmetic.
    """
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK32
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK32
    x = ((x ^ (x >> 16)) * 0x297A2D39) & _MASK32
    return x ^ (x >> 15)


def noise_key(seeds_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
    """The 32-bit key (in int64) of each row's noise: a hash of (seed, position)."""
    return _mix32(_mix32(seeds_B ^ (seeds_B >> 32)) ^ _mix32(positions_B))


def gumbel_at(seeds_B: torch.Tensor, positions_B: torch.Tensor, tokens_BK: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise in float32 of the given token ids [B, K] (int64): a pure function of (seed, position,
    token id), so noise over a candidate set equals the full-vocabulary noise gathered at those ids."""
    bits_BK = _mix32(noise_key(seeds_B, positions_B)[:, None] ^ _mix32(tokens_BK * 0x9E3779B1 + 0x632BE5AB))
    return -torch.log(-torch.log(uniform_of(bits_BK)))


def uniform_of(bits: torch.Tensor) -> torch.Tensor:
    """A float32 in (0, 1), never 0 or 1, from 32 random bits: the top 23 bits + 0.5 (exact in float32's 24-bit
    significand). With 24 bits the largest, 2**24 - 0.5, rounded up to 2**24: u = 1 and infinite noise, so ~1 row in
    120 at a 152k vocabulary sampled a token whatever its probability. The Triton sampler computes the same."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(seeds_B: torch.Tensor, positions_B: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] in float32, a pure function of (seed, position, token id)."""
    token_V = torch.arange(vocab_size, device=seeds_B.device, dtype=torch.int64)
    return gumbel_at(seeds_B, positions_B, token_V[None, :])


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors (static buffers when decode runs in a CUDA graph)."""

    temperature_B: torch.Tensor  # float32; 0 = greedy
    top_p_B: torch.Tensor  # float32
    top_k_B: torch.Tensor  # int64; 0 = off
    seed_B: torch.Tensor  # int64
    position_B: torch.Tensor  # int64: index of the token being sampled in its sequence

    @classmethod
    def empty(cls, batch: int, device: torch.device | str) -> SamplingBatch:
        return cls(
            torch.ones(batch, device=device), torch.ones(batch, device=device),
            torch.zeros(batch, dtype=torch.long, device=device), torch.zeros(batch, dtype=torch.long, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
        )

    def set_rows(self, rows: list[int], params: list[SamplingParams], seeds: list[int], positions: list[int]) -> None:
        """Write several rows with two host-to-device copies (ints, floats), not one per row or field. On CUDA
        from pinned memory, without waiting: a blocking copy of pageable memory waits for the stream, which
        would make the host wait for a decode step launched ahead (decode_pipeline.py)."""
        dev = self.seed_B.device
        ints_4R = torch.tensor([rows, [p.top_k for p in params], seeds, positions], dtype=torch.long)
        floats_2R = torch.tensor([[p.temperature for p in params], [p.top_p for p in params]], dtype=torch.float32)
        if dev.type == "cuda":  # the pinned buffers are kept by torch's host allocator until their copies ran
            ints_4R = ints_4R.pin_memory().to(dev, non_blocking=True)
            floats_2R = floats_2R.pin_memory().to(dev, non_blocking=True)
        else:
            ints_4R, floats_2R = ints_4R.to(dev), floats_2R.to(dev)
        index = ints_4R[0]
        self.temperature_B[index] = floats_2R[0]
        self.top_p_B[index] = floats_2R[1]
        self.top_k_B[index] = ints_4R[1]
        self.seed_B[index] = ints_4R[2]
        self.position_B[index] = ints_4R[3]


def sample(logits_BV: torch.Tensor, batch: SamplingBatch, *, all_greedy: bool = False,
           any_filter: bool = True, top_k_cap: int = 0, vocab_limit: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (token_B int64, logprob_B float32).

    logprob is the sampled token's log-probability under softmax(logits / temperature) (temperature 1 when
    greedy), over the full vocabulary: what the trainer recomputes, not the top-k/top-p-filtered distribution.
    Host-side hints (`sampling_hints`) that skip work, each giving the same tokens as the general path:
    all_greedy: argmax only; any_filter=False (no row has top-k/top-p, what RL decodes): one Gumbel-max pass,
    no sort; top_k_cap = K > 0 (every sampling row has 0 < top_k <= K): sort only the top K candidates.
    vocab_limit = N > 0: ids >= N are never sampled (a model's embedding padded past its tokenizer's vocabulary,
    as Qwen3's: those ids decode to nothing), a filter like top-k: the log-prob stays the full vocabulary's.
    """
    V = logits_BV.shape[-1]
    if 0 < vocab_limit < V:  # sampled among the first N ids (the noise is keyed by id: the same draws)
        token_B, _ = sample(logits_BV[:, :vocab_limit], batch, all_greedy=all_greedy, any_filter=any_filter,
                            top_k_cap=top_k_cap)
        temp_B = torch.where(batch.temperature_B == 0, torch.ones_like(batch.temperature_B), batch.temperature_B)
        scaled_BV = logits_BV.float() / (1.0 if all_greedy else temp_B[:, None])
        return token_B, _logprob_of(scaled_BV, token_B, torch.logsumexp(scaled_BV, dim=-1))
    if all_greedy:
        logits_BV = logits_BV.float()
        token_B = logits_BV.argmax(dim=-1)
        return token_B, _logprob_of(logits_BV, token_B, torch.logsumexp(logits_BV, dim=-1))
    if not any_filter:
        return gumbel_argmax(logits_BV, batch)
    logits_BV = logits_BV.float()
    greedy_B = batch.temperature_B == 0
    temp_B = torch.where(greedy_B, torch.ones_like(batch.temperature_B), batch.temperature_B)
    scaled_BV = logits_BV / temp_B[:, None]
    lse_B = torch.logsumexp(scaled_BV, dim=-1)
    # Filter in sorted order: top-k by rank, top-p by the probability mass (of the full softmax) before each token.
    if 0 < top_k_cap < V:
        cand_BC, order_BC = torch.topk(scaled_BV, top_k_cap, dim=-1)  # sorted, descending
    else:
        cand_BC, order_BC = torch.sort(scaled_BV, dim=-1, descending=True)
    rank_C = torch.arange(cand_BC.shape[-1], device=logits_BV.device)
    k_B = torch.where(batch.top_k_B > 0, batch.top_k_B, V)
    probs_BC = torch.exp(cand_BC - lse_B[:, None])
    mass_before_BC = torch.cumsum(probs_BC, dim=-1) - probs_BC
    keep_BC = (rank_C[None, :] < k_B[:, None]) & (mass_before_BC < batch.top_p_B[:, None])
    keep_BC[:, 0] = True
    noise_BC = gumbel_at(batch.seed_B, batch.position_B, order_BC)
    choice_B = torch.where(keep_BC, cand_BC + noise_BC, float("-inf")).argmax(dim=-1)
    sampled_B = order_BC.gather(1, choice_B[:, None]).squeeze(1)
    token_B = torch.where(greedy_B, logits_BV.argmax(dim=-1), sampled_B)
    return token_B, _logprob_of(scaled_BV, token_B, lse_B)


def _logprob_of(scaled_BV: torch.Tensor, token_B: torch.Tensor, lse_B: torch.Tensor) -> torch.Tensor:
    """log softmax(scaled)[token] as scaled[token] - logsumexp(scaled): no [B, V] log-softmax is written."""
    return scaled_BV.gather(1, token_B[:, None]).squeeze(1) - lse_B


def gumbel_argmax(logits_BV: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling without filters: argmax(logits / T + Gumbel noise) per row (argmax of logits for greedy rows),
    and the token's full-vocabulary log-prob. On CUDA with Triton one fused pass reads the logits once (no
    [B, V] temporaries: noise, scaled logits and log-softmax stay in registers); elsewhere the torch reference."""
    from moerl.kernels import use_triton

    if use_triton(logits_BV) and logits_BV.shape[0] > 0 and fused_sampler_ok(logits_BV.device, logits_BV.dtype):
        from moerl.kernels.triton_sampling import gumbel_argmax_triton

        return gumbel_argmax_triton(logits_BV, batch.temperature_B, noise_key(batch.seed_B, batch.position_B))
    return gumbel_argmax_reference(logits_BV, batch)


@functools.lru_cache(maxsize=None)
def fused_sampler_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton sampler gives the reference's tokens and log-probs on this device (checked once per
    process, eagerly: the Engine calls it before any CUDA graph is captured). A kernel that fails to compile or
    disagrees falls back to the torch reference with a warning instead of sampling wrong tokens."""
    from moerl.kernels.triton_sampling import gumbel_argmax_triton

    g = torch.Generator(device=device).manual_seed(0)
    logits_BV = (4 * torch.randn(8, 5003, generator=g, device=device)).to(dtype)
    batch = SamplingBatch.empty(8, device)
    batch.set_rows(list(range(8)), [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.7, 1.3) * 2],
                   seeds=list(range(8)), positions=[3 * i for i in range(8)])
    try:
        token_B, logprob_B = gumbel_argmax_triton(logits_BV, batch.temperature_B,
                                                  noise_key(batch.seed_B, batch.position_B))
        want_token_B, want_logprob_B = gumbel_argmax_reference(logits_BV, batch)
        ok = torch.equal(token_B, want_token_B) and torch.allclose(logprob_B, want_logprob_B, atol=1e-4, rtol=0)
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: the reference still samples right
        logging.getLogger(__name__).warning("the Triton sampler failed (%s): sampling with the torch reference", e)
        return False
    if not ok:
        logging.getLogger(__name__).warning("the Triton sampler disagrees with its reference on %s %s: sampling "
                                            "with the torch reference", device, dtype)
    return ok


def gumbel_argmax_reference(logits_BV: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    logits_BV = logits_BV.float()
    greedy_B = batch.temperature_B == 0
    temp_B = torch.where(greedy_B, torch.ones_like(batch.temperature_B), batch.temperature_B)
    scaled_BV = logits_BV / temp_B[:, None]
    noisy_BV = scaled_BV + gumbel_noise(batch.seed_B, batch.position_B, logits_BV.shape[-1])
    token_B = torch.where(greedy_B, scaled_BV.argmax(dim=-1), noisy_BV.argmax(dim=-1))
    return token_B, _logprob_of(scaled_BV, token_B, torch.logsumexp(scaled_BV, dim=-1))


def sampling_hints(reqs) -> dict:
    """Host-side facts about a batch that let `sample` skip work (greedy rows ignore top-k/top-p): all greedy;
    any sampling row with a top-k/top-p filter; top_k_cap, the largest top_k when every sampling row has one
    (0 otherwise). Each distinct value is its own decode graph, so a run with one SamplingParams has one."""
    sampling = [r.params for r in reqs if not r.params.greedy]
    capped = bool(sampling) and all(p.top_k > 0 for p in sampling)
    return {"all_greedy": not sampling,
            "any_filter": any(p.top_k > 0 or p.top_p < 1.0 for p in sampling),
            "top_k_cap": max(p.top_k for p in sampling) if capped else 0}
