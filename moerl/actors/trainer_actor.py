"""A trainer rank as a Ray actor: joins the trainer's torch.distributed group and runs PolicyTrainer steps."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moerl.model import build_model, load_pretrained
from moerl.model.config import MoEModelConfig
from moerl.train.loss import LossConfig
from moerl.train.trainer import OptimConfig, PolicyTrainer, Sample, collate


@dataclass
class TrainerSpec:
    arch: dict
    model_path: str
    dtype: str
    device: str
    optim: OptimConfig
    loss: LossConfig
    ep_size: int
    dispatcher: str
    routing_replay: bool
    aux_loss_coef: float
    expert_bias_rate: float
    capacity_factor: float
    seed: int
    threads: int = 1
    data_parallel: str = "fsdp"
    collective_timeout_s: float = 300.0


class TrainerRank:
    def __init__(self, rank: int, world: int, master: str, spec: TrainerSpec) -> None:
        torch.set_num_threads(spec.threads)
        torch.manual_seed(spec.seed + rank)
        self.rank, self.world, self.spec = rank, world, spec
        backend = "nccl" if spec.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=spec.collective_timeout_s))
        group = dist.group.WORLD
        ep_group = group if spec.ep_size > 1 else None
        dtype = getattr(torch, spec.dtype)
        if spec.model_path:
            model = load_pretrained(spec.model_path, dtype=dtype, device=spec.device, expert_parallel_group=ep_group,
                                    dispatcher=spec.dispatcher, capacity_factor=spec.capacity_factor)
        else:
            model = build_model(MoEModelConfig.from_hf_dict(spec.arch), dtype=dtype, device=spec.device,
                                expert_parallel_group=ep_group, dispatcher=spec.dispatcher,
                                capacity_factor=spec.capacity_factor, seed=spec.seed)
        self.trainer = PolicyTrainer(model, spec.optim, spec.loss, group=group if world > 1 else None,
                                     expert_parallel=spec.ep_size > 1, routing_replay=spec.routing_replay,
                                     aux_loss_coef=spec.aux_loss_coef, expert_bias_rate=spec.expert_bias_rate,
                                     data_parallel=spec.data_parallel)

    def set_lr(self, lr: float) -> None:
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = group["initial_lr"] = lr
        self.trainer.scheduler.base_lrs = [lr for _ in self.trainer.scheduler.base_lrs]

    def pid(self) -> int:
        return os.getpid()

    def _batch(self, samples: list[Sample]):
        m = self.trainer.model
        return collate(samples, m.num_moe_layers, m.config.num_experts_per_tok, self.trainer.device)

    def sft_step(self, samples: list[Sample]) -> dict:
        return self.trainer.sft_step(self._batch(samples))

    def rl_step(self, samples: list[Sample]) -> dict:
        return self.trainer.rl_step(self._batch(samples))

    def publish(self, bucket_bytes: int) -> list:
        """This rank's share of the weights as object-store buckets (moerl/actors/weight_sync.py)."""
        from moerl.actors.weight_sync import publish_buckets

        return publish_buckets(self.trainer, self.spec.ep_size > 1, bucket_bytes)

    def save_state(self, path: str, use_async: bool) -> None:
        """Start saving this rank's share (DCP through fsspec); async returns once the state is staged."""
        from moerl.checkpoint.trainer_state import save_trainer_state

        self.wait_save()
        self._pending_save = save_trainer_state(self.trainer, path, use_async=use_async)

    def wait_save(self) -> bool:
        pending, self._pending_save = getattr(self, "_pending_save", None), None
        if pending is not None:
            pending.result()
        return True

    def load_state(self, path: str) -> int:
        from moerl.checkpoint.trainer_state import load_trainer_state

        load_trainer_state(self.trainer, path)
        return self.trainer.steps_done

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
