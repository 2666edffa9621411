"""One trainer rank: the policy's loss on rollout samples (routing replay on), gradient sync, optimizer step.

Shape legend: B sequences on this rank, T positions (right-padded), V vocabulary, L MoE layers, K top-k.

Parallelism: the trainer group is one torch.distributed group (gloo on CPU, NCCL on GPU) of `world` ranks;
data parallel over all ranks, and expert parallel over all of them when `ep_size == world` (each rank holds
E/world experts; the dispatcher's combine-backward already brings every rank's gradient to the expert's
owner, so expert gradients are never reduced). The other parameters are either sharded with FSDP2
(`data_parallel="fsdp"`, the default: gradients reduce-scattered during backward, parameters gathered per
layer) or replicated (`"replicate"`: one flat gradient all-reduce after backward, DDP-style). Gradients are
summed with losses normalised by the global token count, so N ranks step exactly like one rank on the
whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from moerl.model.moe import is_expert_param
from moerl.model.transformer import MoECausalLM
from moerl.train.config import LossConfig, OptimConfig
from moerl.train.loss import policy_loss, sequence_count
from moerl.train.parallel import full_tensor, local, shard_model
from moerl.wire import PackedTensorFields


@dataclass
class Sample(PackedTensorFields):
    """One trained sample as the trainer needs it (built by the controller from a Completion)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    routed_experts: torch.Tensor | None = None  # int16 [len(prompt) + len(completion) - 1, L, K]

    _packed_fields = ("routed_experts",)  # pickled as raw bytes: see moerl/wire.py


@dataclass
class Batch:
    input_ids_BT: torch.Tensor
    target_ids_BT: torch.Tensor
    mask_BT: torch.Tensor  # True where the target is a completion token
    behaviour_BT: torch.Tensor
    advantages_B: torch.Tensor
    routed_BTLK: torch.Tensor | None = None
    lengths_B: torch.Tensor | None = None  # positions per sequence (the rest is padding); None = all
    meta: dict = field(default_factory=dict)

    def valid_BT(self) -> torch.Tensor:
        """True at real (not padding) positions."""
        B, T = self.input_ids_BT.shape
        if self.lengths_B is None:
            return torch.ones(B, T, dtype=torch.bool, device=self.input_ids_BT.device)
        return torch.arange(T, device=self.lengths_B.device)[None] < self.lengths_B[:, None]


def collate(samples: list[Sample], num_moe_layers: int, top_k: int, device: torch.device | str) -> Batch:
    """Right-pad samples into tensors. Inputs are prompt + completion[:-1]: the positions the engine ran."""
    lengths = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples]
    B, T = len(samples), max(lengths, default=1)
    ids = torch.zeros(B, T, dtype=torch.long)
    targets = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    behaviour = torch.zeros(B, T)
    routed = torch.zeros(B, T, num_moe_layers, top_k, dtype=torch.long)
    have_routing = all(s.routed_experts is not None for s in samples)
    for b, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        n, p = lengths[b], len(s.prompt_ids)
        ids[b, :n] = torch.tensor(seq[:-1])
        targets[b, :n] = torch.tensor(seq[1:])
        mask[b, p - 1: n] = True
        behaviour[b, p - 1: n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
        if have_routing:
            if s.routed_experts.shape[0] != n:
                raise ValueError(f"sample {b}: routed_experts covers {s.routed_experts.shape[0]} positions, "
                                 f"expected prompt + completion - 1 = {n}")
            routed[b, :n] = s.routed_experts.long()
    return Batch(ids.to(device), targets.to(device), mask.to(device), behaviour.to(device),
                 torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
                 routed.to(device) if have_routing else None, torch.tensor(lengths, device=device))


class PolicyTrainer:
    def __init__(self, model: MoECausalLM, optim: OptimConfig, loss: LossConfig, *,
                 group: dist.ProcessGroup | None = None, expert_parallel: bool = False,
                 routing_replay: bool = True, aux_loss_coef: float = 0.0, expert_bias_rate: float = 0.0,
                 data_parallel: Literal["fsdp", "replicate"] = "fsdp") -> None:
        if data_parallel not in ("fsdp", "replicate"):
            raise ValueError(f"data_parallel must be 'fsdp' or 'replicate', got {data_parallel!r}")
        self.model, self.optim_cfg, self.loss_cfg = model, optim, loss
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.expert_parallel = expert_parallel
        self.routing_replay, self.aux_loss_coef, self.expert_bias_rate = routing_replay, aux_loss_coef, expert_bias_rate
        if expert_bias_rate > 0:
            model.enable_expert_bias()
        self.fsdp = data_parallel == "fsdp" and self.world > 1
        if self.fsdp:  # before the optimizer: it must hold the sharded parameters
            shard_model(model, group)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / optim.warmup_steps) if optim.warmup_steps else 1.0)
        self.device = next(model.parameters()).device
        self.steps_done = 0

    def _is_expert_param(self, name: str) -> bool:
        return self.expert_parallel and is_expert_param(name)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None and self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def token_logprobs(self, batch: Batch, replay: bool, entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Log-probs of the targets [B, T], the aux loss, tokens per expert [L, E], and (when asked) the
        policy's entropy at each position [B, T]."""
        out = self.model.forward_full(batch.input_ids_BT, routed_experts_BTLK=batch.routed_BTLK if replay else None,
                                      with_aux_loss=self.aux_loss_coef > 0)
        logp_BTV = torch.log_softmax(out.logits_BTV.float(), dim=-1)
        # tokens per expert over the real positions only: padding (which depends on how the batch is split
        # over ranks) must not move the expert bias or the load plots
        routed_NLK = out.routed_experts_BTLK[batch.valid_BT()]
        E = self.model.config.num_experts
        counts_LE = torch.stack([torch.bincount(routed_NLK[:, l].reshape(-1), minlength=E)
                                 for l in range(routed_NLK.shape[1])]) if routed_NLK.shape[1] else out.expert_counts_LE
        entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1) if entropy else None
        return logp_BTV.gather(-1, batch.target_ids_BT[..., None]).squeeze(-1), out.aux_loss, counts_LE, entropy_BT

    def rl_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the policy loss; every rank calls it with its share of the batch."""
        self.model.train()
        # the loss normalisers over all ranks: valid tokens (token-mean) and non-empty sequences (seq-mean-*)
        counts = torch.tensor([batch.mask_BT.sum().item(), sequence_count(batch.mask_BT)], dtype=torch.float64,
                              device=self.device)
        global_tokens, global_seqs = (int(c) for c in self._all_reduce(counts).tolist())
        replay = self.routing_replay and batch.routed_BTLK is not None
        logp_BT, aux, counts_LE, entropy_BT = self.token_logprobs(batch, replay, self.loss_cfg.entropy_coef > 0)
        loss, metrics = policy_loss(logp_BT, logp_BT.detach(), batch.behaviour_BT, batch.advantages_B,
                                    batch.mask_BT, self.loss_cfg, entropy_BT=entropy_BT,
                                    global_tokens=max(global_tokens, 1), global_seqs=max(global_seqs, 1))
        if aux is not None:
            loss = loss + self.aux_loss_coef * aux / self.world
            metrics["loss/aux"] = float(aux.detach())
        return self._apply(loss, metrics, counts_LE, global_tokens)

    def sft_step(self, batch: Batch) -> dict[str, float]:
        """Supervised warm start: token-mean cross-entropy of the completion tokens."""
        self.model.train()
        global_tokens = int(self._all_reduce(batch.mask_BT.sum().to(torch.float64)).item())
        logp_BT, _, counts_LE, _ = self.token_logprobs(batch, replay=False)
        loss = -(logp_BT * batch.mask_BT).sum() / max(global_tokens, 1)
        return self._apply(loss, {"loss/sft": float(loss.detach()) * self.world}, counts_LE, global_tokens)

    def _apply(self, loss: torch.Tensor, metrics: dict, counts_LE: torch.Tensor, tokens: int) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        replicated = [p for n, p in self.model.named_parameters() if p.grad is not None and not self._is_expert_param(n)]
        if self.world > 1 and replicated and not self.fsdp:  # one flat all-reduce rather than one per parameter
            flat = torch.cat([p.grad.reshape(-1) for p in replicated])
            self._all_reduce(flat)
            offset = 0
            for p in replicated:
                p.grad.copy_(flat[offset: offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        metrics["grad_norm"] = self._clip_grad_norm()
        self.optimizer.step()
        self.scheduler.step()
        counts = self._all_reduce(counts_LE.clone())  # all ranks' tokens: for the bias and the load plots
        if self.expert_bias_rate > 0:
            for block, layer_counts in zip(self.model.moe_blocks, counts):
                block.gate.update_expert_bias(layer_counts, self.expert_bias_rate)
        self.steps_done += 1
        metrics.update({"lr": self.scheduler.get_last_lr()[0], "tokens": tokens})
        metrics["expert_counts"] = counts.tolist()
        return metrics

    def _clip_grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        sharded_sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for n, p in self.model.named_parameters():
            if p.grad is not None:
                s = local(p.grad).detach().double().pow(2).sum()
                if self._is_expert_param(n) or self.fsdp:
                    sharded_sq += s
                else:
                    sq += s
        # expert and FSDP shards are disjoint across ranks (replicated experts are FSDP shards too)
        total = sq + self._all_reduce(sharded_sq)
        norm = math.sqrt(float(total))
        if self.optim_cfg.grad_clip > 0 and norm > self.optim_cfg.grad_clip:
            scale = self.optim_cfg.grad_clip / (norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def publish_state(self) -> dict[str, torch.Tensor]:
        """This rank's share of the policy weights for the rollout workers (CPU tensors).

        Without EP only rank 0's copy is needed; with EP every rank sends its expert slices (the worker
        places them by the rank's expert offset) and rank 0 also sends the other parameters. FSDP shards
        are gathered first, one tensor at a time, so a rank never holds more than one whole extra tensor
        (every rank takes part: the gather is a collective).
        """
        rank = dist.get_rank(self.group) if self.group is not None else 0
        out = {}
        for name, t in self.model.state_dict().items():
            t = full_tensor(t.detach())
            if rank == 0 or self._is_expert_param(name):
                out[name] = t.to("cpu", copy=True)
        return out
