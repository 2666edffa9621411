"""A trainer rank as a Ray actor: joins the trainer's torch.distributed group and runs PolicyTrainer steps.

Two phases: the constructor only takes the spec; `join(master)` forms the group and builds the model, once
rank 0 has named a rendezvous address on its own node (`rendezvous`), which may not be the driver's.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moerl.checkpoint.deadline import STORAGE_TIMEOUT_S
from moerl.model import build_model, load_pretrained
from moerl.model.config import MoEModelConfig
from moerl.train.config import LossConfig, OptimConfig
from moerl.train.parallel import trainer_groups
from moerl.train.trainer import PolicyTrainer, Sample


@dataclass
class TrainerSpec:
    arch: dict
    model_path: str
    dtype: str  # compute dtype of forward and backward (model.dtype)
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
    master_dtype: str = "float32"  # parameters and optimizer state
    micro_batch_tokens: int = 0
    minibatches: int = 1  # optimizer updates per RL step (train.minibatches)
    activation_checkpointing: bool | str = False  # False, True or "selective" (moerl/model/checkpointing.py)
    reduce_grads_once: bool = False  # FSDP: one reduce-scatter per step, after the last micro-batch
    temperature: float = 1.0  # the rollout's sampling temperature (the behaviour log-probs are under it)
    # where rank 0 serves the rendezvous stores (which have no authentication): "127.0.0.1" in a local run, whatever
    # address Ray resolved; "" = this node's address as the cluster knows it (a multi-node run)
    store_host: str = ""
    deterministic: bool = False  # torch's deterministic algorithms (run.deterministic; CPU only, preflight checks)


def _leave_sigterm_to_the_driver() -> None:
    """In a Ray actor, SIGTERM is ignored: stopping the run is the driver's, which saves and then ends the ranks.
    A rank that died of a SIGTERM sent to every process (systemd's stop, Slurm's scancel) lost the run: "trainer rank
    0 died during trainer step 5; no checkpoint was committed". (A local Ray's ranks start with it blocked too:
    moerl/startup.py.) Not in a plain process (a test building a rank), whose signals are its own."""
    import ray

    try:
        in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - no Ray context: not an actor
        in_actor = False
    if in_actor and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class TrainerRank:
    def __init__(self, rank: int, world: int, spec: TrainerSpec) -> None:
        torch.set_num_threads(spec.threads)
        torch.manual_seed(spec.seed + rank)
        if spec.deterministic:  # an op without a deterministic kernel then raises instead of varying
            torch.use_deterministic_algorithms(True)
        self.rank, self.world, self.spec = rank, world, spec
        _leave_sigterm_to_the_driver()
        self.device = spec.device
        if spec.device == "cuda":
            # Ray exposes this actor's GPU(s) through CUDA_VISIBLE_DEVICES; outside Ray, LOCAL_RANK picks one
            index = int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.device_count() > 1 else 0
            torch.cuda.set_device(index)
            self.device = f"cuda:{index}"

    def rendezvous(self) -> str:
        """Rank 0 hosts the group's rendezvous store on `store_host` or its node's address (only there: the store
        has no authentication) and returns host:port."""
        from moerl.actors.weight_sync.broadcast import node_address
        from moerl.rendezvous import host_store

        host = self.spec.store_host or node_address()
        self._store = host_store(host, timeout_s=self.spec.collective_timeout_s)
        return f"{host}:{self._store.port}"

    def join(self, master: str) -> int:
        spec = self.spec
        backend = "nccl" if spec.device.startswith("cuda") else "gloo"
        timeout = timedelta(seconds=spec.collective_timeout_s)
        store = getattr(self, "_store", None)
        if store is None:
            host, port = master.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), None, False, timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        groups = trainer_groups(spec.ep_size, torch.device(self.device).type)
        master_dtype = getattr(torch, spec.master_dtype)
        kwargs = dict(dtype=master_dtype, device=self.device, expert_parallel_group=groups.ep,
                      dispatcher=spec.dispatcher, capacity_factor=spec.capacity_factor)
        if spec.model_path:
            model = load_pretrained(spec.model_path, **kwargs)
        else:
            model = build_model(MoEModelConfig.from_hf_dict(spec.arch), seed=spec.seed, **kwargs)
        self.trainer = PolicyTrainer(model, spec.optim, spec.loss, groups=groups, routing_replay=spec.routing_replay,
                                     aux_loss_coef=spec.aux_loss_coef, expert_bias_rate=spec.expert_bias_rate,
                                     data_parallel=spec.data_parallel, compute_dtype=getattr(torch, spec.dtype),
                                     micro_batch_tokens=spec.micro_batch_tokens,
                                     activation_checkpointing=spec.activation_checkpointing,
                                     reduce_grads_once=spec.reduce_grads_once,
                                     temperature=spec.temperature, minibatches=spec.minibatches)
        return os.getpid()

    def set_lr(self, lr: float) -> None:
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = group["initial_lr"] = lr
        self.trainer.scheduler.base_lrs = [lr for _ in self.trainer.scheduler.base_lrs]

    def pid(self) -> int:
        return os.getpid()

    def sft_step(self, samples: list[Sample]) -> dict:
        return self.trainer.sft_step(samples)

    def rl_step(self, samples: list[Sample]) -> dict:
        return self.trainer.rl_step(samples)

    def location(self):
        """Where this rank's weight buffers live (its Ray node and GPU): who can map them."""
        from moerl.actors.weight_sync.shared import Location

        return Location.here(self.device)

    def publish(self, version: int, forms: tuple[str, ...], bucket_bytes: int, timeout_s: float,
                group: tuple[int, int] | None = None) -> dict[str, list]:
        """This rank's share of the weights in each of `forms`; `group` = (generation, world) of the broadcast
        group when "broadcast" is one of them (moerl/actors/weight_sync/publisher.py)."""
        from moerl.actors.weight_sync.publisher import Publisher

        if getattr(self, "_publisher", None) is None:
            self._publisher = Publisher(self.trainer, self.spec.ep_size > 1, bucket_bytes, timeout_s,
                                        host=self.spec.store_host)
        return self._publisher.publish(version, forms, group)

    def export(self, version: int) -> list | None:
        """`version` as object-store buckets if this rank still holds it (a late worker's catch-up)."""
        return self._publisher.export(version) if getattr(self, "_publisher", None) is not None else None

    def save_state(self, path: str, use_async: bool, target=None) -> None:
        """Start saving this rank's share (DCP through fsspec); async returns once the state is staged.
        target: the step (moerl.checkpoint.storage.StepTarget), cleared first and its storage deadline kept."""
        from moerl.checkpoint.trainer_state import save_trainer_state

        self.wait_save()
        self._pending_save = save_trainer_state(
            self.trainer, path, use_async=use_async, before_write=target.begin if target is not None else None,
            timeout_s=target.timeout_s if target is not None else STORAGE_TIMEOUT_S)

    def wait_save(self) -> dict[str, str]:
        """The checksums of the files this rank's last save wrote (none when no save is pending)."""
        pending, self._pending_save = getattr(self, "_pending_save", None), None
        return pending.result() if pending is not None else {}

    def load_state(self, path: str, timeout_s: float = STORAGE_TIMEOUT_S) -> int:
        from moerl.checkpoint.trainer_state import load_trainer_state

        load_trainer_state(self.trainer, path, timeout_s)
        return self.trainer.steps_done

    def shutdown(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._publisher.close()
        if dist.is_initialized():
            dist.destroy_process_group()
