"""One trainer rank: the policy's loss on rollout samples, in token-budget micro-batches and `minibatches` optimizer
updates per step.

Shape legend: S sequences of a micro-batch, P its longest sequence, T packed positions, L MoE layers, E experts.

A step (`rl_step`, `sft_step`) takes this rank's samples (the driver splits a batch over the ranks by tokens,
`batching.split_by_tokens`). An RL step with several updates (or M2PO's mask) first runs one no-grad forward of
them all: the step-start log-probs, the proximal policy of moerl/train/loss.py. Then, for each of its
`minibatches` contiguous shares (`batching.split_contiguous`), one update: the share packed into micro-batches of
at most `micro_batch_tokens` positions with no padding rows, and for each: forward (routing replay on the experts
the rollout chose), token log-probs from the final hidden states in chunks (never tokens x vocabulary in
float32), the loss normalised by the update's global token (or sequence) count, backward. Gradients accumulate in
float32 on the float32 master parameters; one clip and one AdamW step follow (its learning rate times sqrt(ESS)
with `loss.ess_lr_scaling`). Every rank runs the same number of micro-batches (the shortest pad with empty
ones) because every forward joins collectives (FSDP gathers, EP all-to-alls).

Parallelism and mixed precision: moerl/train/parallel.py. Summed gradients of losses normalised by global
counts make W ranks step like one rank on the whole batch, and any micro-batch budget like one micro-batch.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator, Literal

import torch
import torch.distributed as dist

from moerl.model.checkpointing import CheckpointMode
from moerl.model.moe import is_expert_param
from moerl.model.transformer import MoECausalLM
from moerl.train.batching import PackedBatch, micro_batches, pack, split_contiguous
from moerl.train.config import LossConfig, OptimConfig
from moerl.train.loss import effective_sample_size, m2po_cutoff, off_policy_log_weights, policy_loss
from moerl.train.parallel import TrainerGroups, compute_cast, full_tensor, local, shard_model
from moerl.train.sample import Sample
from moerl.train.step_metrics import merge_micro_batch, merge_rank_metrics, merge_updates

__all__ = ["LossConfig", "OptimConfig", "PolicyTrainer", "Sample", "merge_rank_metrics"]

_PROBE = 1024  # elements per tensor sampled for update/param_change_frac
PROXIMAL_NEEDS_MINIBATCHES = ("trust_region 'proximal' with one update per step bounds nothing (the ratio to the "
                              "step-start policy is 1 on the only update): set train.minibatches >= 2, or "
                              "trust_region 'behaviour'")


class PolicyTrainer:
    def __init__(self, model: MoECausalLM, optim: OptimConfig, loss: LossConfig, *,
                 groups: TrainerGroups | None = None, routing_replay: bool = True, aux_loss_coef: float = 0.0,
                 expert_bias_rate: float = 0.0, data_parallel: Literal["fsdp", "replicate"] = "fsdp",
                 compute_dtype: torch.dtype | None = None, micro_batch_tokens: int = 0,
                 activation_checkpointing: CheckpointMode = False, logprob_chunk_tokens: int | None = None,
                 temperature: float = 1.0, reduce_grads_once: bool = False, minibatches: int = 1) -> None:
        """model: built in the master dtype (float32), its experts already split by `groups.ep`.
        compute_dtype: forward/backward dtype (None = the parameters'). micro_batch_tokens: positions per
        micro-batch (0 = all of the rank's samples in one). temperature: the rollout's sampling temperature:
        the behaviour log-probs are of softmax(logits / temperature), so the policy's must be too.
        reduce_grads_once: FSDP only: gradients accumulate unsharded (float32) over the micro-batches and are
        reduce-scattered once, after the last (FSDP2's `set_requires_gradient_sync`), not after each.
        minibatches: optimizer updates per RL step, each over a contiguous share of this rank's samples."""
        if data_parallel not in ("fsdp", "replicate"):
            raise ValueError(f"data_parallel must be 'fsdp' or 'replicate', got {data_parallel!r}")
        if minibatches < 1:
            raise ValueError(f"minibatches must be >= 1, got {minibatches}")
        loss.validate()
        if loss.trust_region == "proximal" and minibatches == 1:
            raise ValueError(PROXIMAL_NEEDS_MINIBATCHES)
        self.minibatches = minibatches
        self.model, self.optim_cfg, self.loss_cfg = model, optim, loss
        self.groups = groups or TrainerGroups(None, None, 1, None)
        self.group, self.world, self.rank = self.groups.world, self.groups.world_size, self.groups.rank
        self.expert_parallel = self.groups.ep_size > 1
        if self.expert_parallel and data_parallel == "replicate" and self.groups.ep_size != self.world:
            raise ValueError("expert parallelism over part of the ranks needs data_parallel='fsdp' (the replicas "
                             "of an expert slice are FSDP-sharded)")
        self.routing_replay, self.aux_loss_coef, self.expert_bias_rate = routing_replay, aux_loss_coef, expert_bias_rate
        self.micro_batch_tokens, self.logprob_chunk_tokens = micro_batch_tokens, logprob_chunk_tokens
        self.reduce_grads_once = reduce_grads_once
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts: the plain distribution
        param = next(model.parameters())
        self.device, self.master_dtype = param.device, param.dtype
        self.compute_dtype = compute_dtype if compute_dtype not in (None, param.dtype) else None
        if expert_bias_rate > 0:
            model.enable_expert_bias()
        if activation_checkpointing:
            model.enable_activation_checkpointing(activation_checkpointing)
        self.fsdp = data_parallel == "fsdp" and self.world > 1
        if self.fsdp:  # before the optimizer: it must hold the sharded parameters
            shard_model(model, self.groups, self.compute_dtype)
        # CUDA: the fused AdamW (one kernel per group of tensors, the moments read and written once; 160 ms of the
        # optimizer split's row at 1.9B parameters was the multi-tensor-apply chain). CPU: torch's default, as before
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay,
                                           fused=True if self.device.type == "cuda" else None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / optim.warmup_steps) if optim.warmup_steps else 1.0)
        self.steps_done = 0
        # Buffers (the router's expert bias) travel in their own dtype: a bias step of 1e-3 on a bias of ~0.1
        # would round away in bf16, and the engine would choose other experts than the trainer
        self._buffers = {name for name, _ in model.named_buffers()}

    # ------------------------------------------------------------------ steps
    def rl_step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL step of the policy loss: `minibatches` optimizer updates over this rank's share of the batch,
        in order; every rank calls it with its share. With several updates (or M2PO's mask) a no-grad forward
        first takes the step-start log-probs, the proximal policy the clip and the off-policy weights measure."""
        cfg = self.loss_cfg
        replay = self.routing_replay and all(s.routed_experts is not None for s in samples)
        start: dict[int, torch.Tensor] | None = None
        t0 = self._now()
        if cfg.needs_step_start(self.minibatches):
            start = dict(zip(map(id, samples), self._forward_logprobs(samples, replay, self.temperature)))
        cutoff = self._m2_cutoff(samples, start) if cfg.is_correction == "m2po" else None
        proximal_s = self._now() - t0

        def loss_fn(batch: PackedBatch, chunk: list[Sample], out, tokens: int, seqs: int, n_micro: int):
            logp_SP = batch.to_grid(out.logprobs_1T)
            prox_SP = logp_SP.detach()
            if start is not None and chunk:  # the mask's True cells are the samples' completion tokens, in order
                prox_SP = torch.zeros_like(logp_SP, dtype=torch.float32)
                prox_SP[batch.mask_SP] = torch.cat([start[id(s)] for s in chunk])
            loss, metrics = policy_loss(logp_SP, prox_SP, batch.behaviour_SP, batch.advantages_S, batch.mask_SP, cfg,
                                        entropy_BT=batch.to_grid(out.entropy_1T), global_tokens=max(tokens, 1),
                                        global_seqs=max(seqs, 1), m2_cutoff=cutoff)
            if out.aux_loss is not None:  # the mean over ranks and micro-batches of the balancing loss
                loss = loss + self.aux_loss_coef * out.aux_loss / (self.world * n_micro)
                metrics["loss/aux"] = float(out.aux_loss.detach()) / n_micro
            return loss, metrics
        chunks = split_contiguous(samples, self.minibatches)
        updates = [self._step(chunk, loss_fn, replay, with_entropy=True, temperature=self.temperature,
                              skip_empty=len(chunks) > 1) for chunk in chunks]
        metrics = merge_updates([u for u in updates if u] or updates[:1])
        for key in ("is/w_sum", "is/w_sq_sum"):
            metrics.pop(key, None)
        if start is not None:
            metrics["time/proximal_s"] = proximal_s
        return metrics

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """Supervised warm start: token-mean cross-entropy of the completion tokens."""
        def loss_fn(batch: PackedBatch, chunk: list[Sample], out, tokens: int, seqs: int, n_micro: int):
            loss = -(batch.to_grid(out.logprobs_1T) * batch.mask_SP).sum() / max(tokens, 1)
            return loss, {"loss/sft": float(loss.detach()), "tokens": float(batch.mask_SP.sum())}  # summed over ranks
        return self._step(samples, loss_fn, replay=False, with_entropy=False, temperature=1.0)

    def _step(self, samples: list[Sample], loss_fn: Callable, replay: bool, with_entropy: bool,
              temperature: float, skip_empty: bool = False) -> dict[str, float]:
        """One optimizer update over `samples` (this rank's), in micro-batches. skip_empty: no update at all (and
        {} back) when no rank has a token, as every rank sees from the same global count."""
        self.model.train()
        # global normalisers (completion tokens, non-empty completions) and the micro-batch count, in one call
        local_bins = micro_batches(samples, self.micro_batch_tokens)
        tokens, seqs = sum(len(s.completion_ids) for s in samples), sum(bool(s.completion_ids) for s in samples)
        # token ids outside the vocabulary: one line here, on every rank, before any work (on CUDA the embedding
        # and log-prob kernels would end the process with a device-side assert instead)
        bad = _first_out_of_vocab(samples, self.model.config.vocab_size)
        counts = self._all_reduce(torch.tensor([tokens, seqs, bad is not None], dtype=torch.float64,
                                               device=self.device))
        n_micro = int(self._all_reduce(torch.tensor([len(local_bins)], device=self.device), dist.ReduceOp.MAX))
        global_tokens, global_seqs, bad_ranks = (int(c) for c in counts.tolist())
        if bad_ranks:
            raise ValueError(bad or f"{bad_ranks} other trainer rank(s) got token ids outside the vocabulary")
        if skip_empty and global_tokens == 0:
            return {}
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        counts_LE = torch.zeros(self.model.num_moe_layers, self.model.config.num_experts, dtype=torch.long,
                                device=self.device)
        m = self.model
        t0 = self._now()
        for i in range(n_micro):  # ranks with fewer micro-batches run empty ones: every forward is collective
            chunk = local_bins[i] if i < len(local_bins) else []
            batch = pack(chunk, m.num_moe_layers, m.config.num_experts_per_tok, self.device,
                         m.config.pad_token_id or 0)
            real = i < len(local_bins)
            if self.fsdp and self.reduce_grads_once:  # every rank runs n_micro backwards: the last one syncs
                m.set_requires_gradient_sync(i == n_micro - 1)
            with compute_cast(m, None if self.fsdp else self.compute_dtype):
                out = m.forward_logprobs(batch.input_ids_1T, batch.target_ids_1T, packed=batch.packed,
                                         routed_experts_BTLK=batch.routed_1TLK if (replay or not real) else None,
                                         with_aux_loss=self.aux_loss_coef > 0, with_entropy=with_entropy,
                                         chunk_tokens=self.logprob_chunk_tokens, temperature=temperature)
                loss, mb_metrics = loss_fn(batch, chunk, out, global_tokens, global_seqs, n_micro)
                if not real:  # keeps every parameter in the graph (FSDP's reduce-scatter runs on every rank)
                    loss = loss + 0.0 * out.logprobs_1T.sum()
                loss.backward()  # inside: checkpointed layers recompute with the same (cast) weights
            if real:
                counts_LE += _expert_counts(out.routed_experts_BTLK, m.config.num_experts)
                merge_micro_batch(metrics, mb_metrics)
        metrics["time/fwd_bwd_s"] = self._now() - t0
        return self._apply(metrics, counts_LE, global_tokens)

    @torch.no_grad()
    def _forward_logprobs(self, samples: list[Sample], replay: bool, temperature: float) -> list[torch.Tensor]:
        """Each sample's completion-token log-probs under the current weights (float32, on the trainer's device),
        computed as an update computes them (packing, micro-batches, compute dtype, routing replay, temperature)
        with no gradient. Collective: every rank runs as many micro-batches as the rank with the most."""
        m = self.model
        bins = micro_batches(samples, self.micro_batch_tokens)
        n_micro = int(self._all_reduce(torch.tensor([len(bins)], device=self.device), dist.ReduceOp.MAX))
        by_id: dict[int, torch.Tensor] = {}
        for i in range(n_micro):
            chunk = bins[i] if i < len(bins) else []
            batch = pack(chunk, m.num_moe_layers, m.config.num_experts_per_tok, self.device,
                         m.config.pad_token_id or 0)
            with compute_cast(m, None if self.fsdp else self.compute_dtype):
                out = m.forward_logprobs(batch.input_ids_1T, batch.target_ids_1T, packed=batch.packed,
                                         routed_experts_BTLK=batch.routed_1TLK if (replay or not chunk) else None,
                                         chunk_tokens=self.logprob_chunk_tokens, temperature=temperature)
            logp_SP = batch.to_grid(out.logprobs_1T).float()
            for j, sample in enumerate(chunk):
                by_id[id(sample)] = logp_SP[j][batch.mask_SP[j]]
        return [by_id[id(s)] for s in samples]

    def _m2_cutoff(self, samples: list[Sample], start: dict[int, torch.Tensor]) -> float:
        """M2PO's cutoff over the whole step: every rank's log-weights gathered (padded to the longest), the same
        number on every rank."""
        log_w_N = torch.cat([off_policy_log_weights(start[id(s)], torch.tensor(s.model_behaviour(),
                                                                                device=self.device))
                             for s in samples]) if samples else torch.zeros(0, dtype=torch.float64, device=self.device)
        if self.group is not None and self.world > 1:
            n = int(self._all_reduce(torch.tensor([log_w_N.numel()], device=self.device), dist.ReduceOp.MAX))
            padded = torch.full((n,), math.nan, dtype=torch.float64, device=self.device)
            padded[: log_w_N.numel()] = log_w_N
            gathered = torch.empty(n * self.world, dtype=torch.float64, device=self.device)
            # all_gather_single from torch 2.13 on (its predecessor warns there), all_gather_into_tensor before
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, padded, group=self.group)
            log_w_N = gathered[~gathered.isnan()]
        return m2po_cutoff(log_w_N, self.loss_cfg.m2_threshold)

    def token_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Each sample's completion-token log-probs under the current weights, computed as `rl_step` computes
        them (packing, micro-batches, compute dtype, routing replay, temperature) but with no step: what the
        rollout's log-probs are checked against (tests/gpu). float32 on the CPU, in the samples' order; every rank
        calls it with its own samples."""
        replay = self.routing_replay and all(s.routed_experts is not None for s in samples)
        return [t.cpu() for t in self._forward_logprobs(samples, replay, self.temperature)]

    def _now(self) -> float:
        """A clock reading after the device's queued work (CUDA runs asynchronously to the host)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _apply(self, metrics: dict, counts_LE: torch.Tensor, tokens: int) -> dict[str, float]:
        if self.world > 1 and not self.fsdp:  # replicated weights: one flat float32 all-reduce of the gradients
            replicated = [p for n, p in self.model.named_parameters()
                          if p.grad is not None and not self._is_expert_param(n)]
            if replicated:
                flat = torch.cat([p.grad.reshape(-1) for p in replicated])
                self._all_reduce(flat)
                offset = 0
                for p in replicated:
                    p.grad.copy_(flat[offset: offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        t0 = self._now()
        metrics["grad_norm"] = self._clip_grad_norm()
        scale = self._ess(metrics, tokens)
        probe = _ChangeProbe(self.model, self.compute_dtype)
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:  # VCPO: this update's step shrinks with its weights' ESS
            group["lr"] *= scale
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.scheduler.step()
        metrics["time/optimizer_s"] = self._now() - t0
        counts = self._all_reduce(counts_LE.clone())  # all ranks' tokens: for the bias and the load plots
        if self.expert_bias_rate > 0:
            for block, layer_counts in zip(self.model.moe_blocks, counts):
                block.gate.update_expert_bias(layer_counts, self.expert_bias_rate)
        self.steps_done += 1
        metrics.update(probe.result())
        # "tokens" becomes the step's global count; this rank's own weighs its means in merge_rank_metrics
        metrics["rank_tokens"] = metrics.get("tokens", 0.0)
        metrics.update({"lr": self.scheduler.get_last_lr()[0], "tokens": tokens})
        metrics["expert_counts"] = counts.tolist()
        return metrics

    # ------------------------------------------------------------------ helpers
    def _ess(self, metrics: dict, tokens: int) -> float:
        """The update's effective sample size over every rank's tokens (`is/ess`, with its global sums), and the
        learning-rate factor it gives: sqrt(ESS) with `ess_lr_scaling` (VCPO's rule for AdamW), else 1."""
        if "is/w_sum" not in metrics:  # a supervised step: no off-policy weights
            return 1.0
        sums = self._all_reduce(torch.tensor([metrics["is/w_sum"], metrics["is/w_sq_sum"]], dtype=torch.float64,
                                             device=self.device))
        metrics["is/w_sum"], metrics["is/w_sq_sum"] = sums.tolist()
        metrics["is/ess"] = effective_sample_size(metrics["is/w_sum"], metrics["is/w_sq_sum"], tokens)
        scale = math.sqrt(metrics["is/ess"]) if self.loss_cfg.ess_lr_scaling else 1.0
        metrics["optim/lr_scale"] = scale
        return scale

    def _is_expert_param(self, name: str) -> bool:
        return self.expert_parallel and is_expert_param(name)

    def _all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.group is not None and self.world > 1:
            dist.all_reduce(t, op=op, group=self.group)
        return t

    def _clip_grad_norm(self) -> float:
        """The global gradient norm (float64 sums of squares), and the clip when it exceeds `grad_clip`: one
        norm kernel and one scale kernel per group of tensors (torch's foreach ops), one host sync."""
        local_grads: list[torch.Tensor] = []
        sharded_grads: list[torch.Tensor] = []
        for n, p in self.model.named_parameters():
            if p.grad is not None:
                (sharded_grads if self._is_expert_param(n) or self.fsdp else local_grads).append(local(p.grad).detach())
        sq, sharded_sq = (self._sum_squares(g) for g in (local_grads, sharded_grads))
        # expert and FSDP shards are disjoint across ranks (replicated experts are FSDP shards too)
        total = sq + self._all_reduce(sharded_sq)
        norm = math.sqrt(float(total))
        if self.optim_cfg.grad_clip > 0 and norm > self.optim_cfg.grad_clip:
            torch._foreach_mul_(local_grads + sharded_grads, self.optim_cfg.grad_clip / (norm + 1e-6))
        return norm

    def _sum_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """sum of squares of all elements, float64: per-tensor float64 norms (foreach, no float64 copies)."""
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).pow(2).sum()

    def publish_state(self) -> dict[str, torch.Tensor]:
        """This rank's share of the policy weights for the rollout workers (`publish_items`) as CPU tensors in
        the published dtype: the reference the weight-sync transports are checked against."""
        return {name: t.to(self.publish_dtype(name, t)).to("cpu", copy=True) for name, t in self.publish_items()}

    def publish_dtype(self, name: str, t: torch.Tensor) -> torch.dtype:
        """Weights travel in the compute dtype (half the bytes of float32 master weights under bf16); buffers and
        integer tensors in their own."""
        if not t.is_floating_point() or name in self._buffers:
            return t.dtype
        return self.compute_dtype or self.master_dtype

    def publish_spec(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, published dtype, whole shape) of this rank's share, in `publish_items` order, without data."""
        return [(name, self.publish_dtype(name, t), tuple(t.shape)) for name, t in self.model.state_dict().items()
                if self._publishes(name)]

    def publish_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's share of the policy weights, whole, on the trainer's device, in the master dtype.

        Rank 0 sends the dense parameters; with EP the first replica of each expert slice sends it (the worker
        places it by the slice's expert offset). FSDP shards are gathered one tensor at a time, so a rank never
        holds more than one whole extra tensor; every rank must run this to the end (the gathers are collectives).
        """
        for name, t in self.model.state_dict().items():
            t = full_tensor(t.detach())
            if self._publishes(name):
                yield name, t

    def _publishes(self, name: str) -> bool:
        return self.groups.efsdp_rank == 0 if self._is_expert_param(name) else self.rank == 0


def _first_out_of_vocab(samples: list[Sample], vocab: int) -> str | None:
    """Why the first sample whose token ids fall outside [0, vocab) is bad, or None (a pass over host lists)."""
    for i, s in enumerate(samples):
        for part in ("prompt_ids", "completion_ids"):
            ids = getattr(s, part)
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                return (f"sample {i}: {part} holds ids in [{min(ids)}, {max(ids)}], outside the vocabulary "
                        f"[0, {vocab})")
    return None


def _expert_counts(routed_1TLK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert per MoE layer [L, E] (a packed batch has no padding positions)."""
    routed_NLK = routed_1TLK.reshape(-1, *routed_1TLK.shape[2:])
    return torch.stack([torch.bincount(routed_NLK[:, l].reshape(-1), minlength=num_experts)
                        for l in range(routed_NLK.shape[1])]) if routed_NLK.shape[1] else \
        routed_1TLK.new_zeros(0, num_experts)


class _ChangeProbe:
    """How many master weights an optimizer step moves, and how many of their compute-dtype copies (what the
    rollout engine gets): on up to `_PROBE` evenly spaced elements of each of this rank's parameter shards."""

    def __init__(self, model: torch.nn.Module, compute_dtype: torch.dtype | None) -> None:
        self.compute_dtype = compute_dtype
        self.params = [local(p).detach() for p in model.parameters()]
        self.before = [self._sample(p).clone() for p in self.params]

    @staticmethod
    def _sample(p: torch.Tensor) -> torch.Tensor:
        flat = p.reshape(-1)
        return flat[:: max(1, flat.numel() // _PROBE)][:_PROBE]

    def result(self) -> dict[str, float]:
        changed = published = total = 0
        for p, before in zip(self.params, self.before):
            after = self._sample(p)
            changed += int((after != before).sum())
            if self.compute_dtype is not None:
                published += int((after.to(self.compute_dtype) != before.to(self.compute_dtype)).sum())
            total += after.numel()
        out = {"update/param_change_frac": changed / max(total, 1)}
        out["update/published_change_frac"] = (published if self.compute_dtype is not None else changed) / max(total, 1)
        return out
