"""The trainer's state through torch.distributed.checkpoint (DCP): model, AdamW, scheduler, RNG, steps.

Every rank of the trainer group calls `save_trainer_state` / `load_trainer_state` together. The state is one
flat dict of tensors (so DCP never pickles an object of ours; non-tensor values travel as JSON bytes):

    model/<name>                       replicated parameters and buffers: DCP writes them once
    model/<name>@ep{r}of{P}            expert tensors of EP rank r of P: same names on every rank, different
                                       contents, so the key must differ or DCP would keep one rank's copy
    optim/<key>/{exp_avg,exp_avg_sq,step}   AdamW state per parameter, under the parameter's key
    json/optim_groups, json/scheduler, json/trainer   hyper-parameters, LambdaLR state, steps_done
    rng/cpu@rank{r}of{W}, rng/cuda@rank{r}of{W}       each rank's generators

Under FSDP2 the model and AdamW tensors are DTensors: DCP writes each rank's shard once under the tensor's
global key and shape, so a checkpoint does not depend on how the trainer was sharded (replicated or FSDP,
any rank count with the same EP size). Loading reads whole tensors and each rank keeps its shard.

Loading checks the checkpoint's metadata (names, shapes, dtypes, EP size) against the trainer BEFORE
changing anything, so an incompatible resume fails with a CheckpointError naming what differs.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
import weakref
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

from moerl.checkpoint.dcp_files import _MetadataUnpickler, cause_of, load_into, read_metadata, writer  # noqa: F401
from moerl.checkpoint.deadline import STORAGE_TIMEOUT_S
from moerl.model.config import CheckpointError
from moerl.model.moe import SparseMoEBlock
from moerl.model.transformer import MoECausalLM

log = logging.getLogger(__name__)
# no_dist is deliberate here (one process, or a per-rank load); DCP warns on every such call, also from the
# upload thread, so a filter scoped to a `with` would miss it.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

EP_KEY = re.compile(r"^(.+)@ep(\d+)of(\d+)$")
_JSON_KEYS = ("json/optim_groups", "json/scheduler", "json/trainer")
# Per trainer: the gloo group DCP's background upload thread uses for its collectives (never the training
# group: two threads issuing collectives on one group interleave differently across ranks and hang), and
# the upload in flight (a new save waits for it, so the checkpoint group sees one save at a time).
_CKPT_GROUP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_IN_FLIGHT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def like(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` (the whole tensor, present on every rank) laid out like `target`: this rank's shard of it when
    `target` is an FSDP DTensor (cut locally, no communication), else `full` itself."""
    if isinstance(target, DTensor):
        full = full.to(device=target.device, dtype=target.dtype)
        return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
    return full


# ---------------------------------------------------------------------------------------- keys
def expert_shards(model: MoECausalLM) -> dict[str, tuple[int, int]]:
    """State-dict name -> (EP rank, EP size) for every expert tensor split over an expert-parallel group."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, SparseMoEBlock) and module.dispatcher.world_size > 1:
            d = module.dispatcher
            for which in ("gate_up_proj", "down_proj"):
                out[f"{name}.experts.{which}"] = (d.rank, d.world_size)
    return out


def _key(name: str, shards: dict[str, tuple[int, int]]) -> str:
    r = shards.get(name)
    return f"{name}@ep{r[0]}of{r[1]}" if r else name


def _rank_world(trainer) -> tuple[int, int]:
    if trainer.group is None:
        return 0, 1
    return dist.get_rank(trainer.group), dist.get_world_size(trainer.group)


def _json_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _from_json_tensor(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.tolist()).decode())


def _param_keys(trainer) -> list[tuple[str, torch.nn.Parameter]]:
    """(checkpoint key, parameter) in optimizer order: the optimizer state follows the model's key scheme."""
    shards = expert_shards(trainer.model)
    by_id = {id(p): _key(n, shards) for n, p in trainer.model.named_parameters()}
    return [(by_id[id(p)], p) for g in trainer.optimizer.param_groups for p in g["params"]]


# ---------------------------------------------------------------------------------------- state dict
def trainer_state_dict(trainer) -> dict[str, torch.Tensor]:
    """This rank's state as a flat dict of tensors (live references: DCP's staging copies them)."""
    shards = expert_shards(trainer.model)
    sd: dict[str, torch.Tensor] = {f"model/{_key(n, shards)}": t for n, t in trainer.model.state_dict().items()}
    for key, p in _param_keys(trainer):
        for s, v in trainer.optimizer.state.get(p, {}).items():
            sd[f"optim/{key}/{s}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
    sd["json/optim_groups"] = _json_tensor(groups)
    sched = {k: v for k, v in trainer.scheduler.state_dict().items() if k != "lr_lambdas"}
    sd["json/scheduler"] = _json_tensor(sched)
    ep = max([w for _, w in shards.values()], default=1)
    sd["json/trainer"] = _json_tensor({"steps_done": trainer.steps_done, "ep_size": ep,
                                       "bias_enabled": [b.gate.bias_enabled for b in trainer.model.moe_blocks]})
    rank, world = _rank_world(trainer)
    sd[f"rng/cpu@rank{rank}of{world}"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        sd[f"rng/cuda@rank{rank}of{world}"] = torch.cuda.get_rng_state()
    return sd


def load_trainer_state_dict(trainer, sd: dict[str, torch.Tensor]) -> None:
    """Apply a dict shaped like `trainer_state_dict`'s (already checked against the trainer)."""
    shards = expert_shards(trainer.model)
    live = trainer.model.state_dict()
    # whole tensors in `sd`; an FSDP-sharded trainer takes its shard of each (so any rank count can resume)
    model_sd = {n: like(t, sd[f"model/{_key(n, shards)}"]) for n, t in live.items()}
    trainer.model.load_state_dict(model_sd, strict=True)
    keys = _param_keys(trainer)
    state = {}
    for i, (key, p) in enumerate(keys):
        prefix = f"optim/{key}/"
        entry = {k[len(prefix):]: (v if k.endswith("/step") else like(p, v)) for k, v in sd.items()
                 if k.startswith(prefix)}
        if entry:
            state[i] = entry
    groups, i = [], 0
    for g, saved in zip(trainer.optimizer.param_groups, _from_json_tensor(sd["json/optim_groups"])):
        saved = {k: tuple(v) if isinstance(g.get(k), tuple) else v for k, v in saved.items()}
        groups.append({**saved, "params": list(range(i, i + len(g["params"])))})
        i += len(g["params"])
    # load_state_dict casts exp_avg* to each parameter's dtype/device and keeps `step` as saved (float32 CPU)
    trainer.optimizer.load_state_dict({"state": state, "param_groups": groups})
    sched = trainer.scheduler.state_dict()
    sched.update(_from_json_tensor(sd["json/scheduler"]))
    trainer.scheduler.load_state_dict(sched)
    meta = _from_json_tensor(sd["json/trainer"])
    trainer.steps_done = int(meta["steps_done"])
    for block, on in zip(trainer.model.moe_blocks, meta["bias_enabled"]):
        block.gate.bias_enabled = bool(on)
    rank, world = _rank_world(trainer)
    cpu = sd.get(f"rng/cpu@rank{rank}of{world}")
    if cpu is None:  # resumed with another number of ranks: weights are exact, the random streams are not
        log.warning("checkpoint has no RNG state for rank %d of %d; RNG not restored", rank, world)
    else:
        torch.set_rng_state(cpu)
    cuda = sd.get(f"rng/cuda@rank{rank}of{world}")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


# ---------------------------------------------------------------------------------------- save
def _checkpoint_group(trainer) -> dist.ProcessGroup:
    """A gloo group over the trainer's ranks, only for checkpoint collectives (created once, collectively)."""
    group = _CKPT_GROUP.get(trainer)
    if group is None:
        group = dist.new_group(ranks=dist.get_process_group_ranks(trainer.group), backend="gloo")
        _CKPT_GROUP[trainer] = group
    return group


# DCP writes one file per writer thread and rank, uploaded in parallel: 4 halved save and load times of a
# 200 MB state to S3 against 1 (moerl bench checkpoint; a single s3fs file uploads its parts one at a time).
WRITER_THREADS = 4


def save_trainer_state(trainer, path: str, *, use_async: bool, thread_count: int = WRITER_THREADS,
                       before_write: Callable[[], None] | None = None,
                       timeout_s: float = STORAGE_TIMEOUT_S) -> Future[dict[str, str]]:
    """Write this rank's state under `path` (local dir or s3://...); all trainer ranks call it together.

    Returns a Future of the checksums of the files this rank wrote (relative to `path`), hashed while they
    were written: pass them (every rank's, under the step's trainer directory) to `CheckpointStore.commit`.
    use_async=True returns once the state is copied (staged) to CPU memory; the upload runs in a thread and
    the Future completes when every file and the DCP metadata are written. Wait on it before committing the
    step. use_async=False returns it completed. A save first waits for the previous upload of this trainer.
    A write that failed in any of DCP's writer threads fails the save (the Future's exception names the file).

    before_write: run once, by the coordinating rank, before any rank writes (the Checkpointer clears the step
    directory this way: `CheckpointStore.begin`). timeout_s: the deadline of each storage call."""
    previous = _IN_FLIGHT.pop(trainer, None)
    if previous is not None:
        previous.result()
    w = writer(path, thread_count, before_write, timeout_s)
    kwargs: dict[str, Any] = {"no_dist": True} if trainer.group is None else {"process_group": _checkpoint_group(trainer)}
    sd = trainer_state_dict(trainer)
    done: Future[dict[str, str]] = Future()
    if not use_async:
        try:
            dcp.save(sd, storage_writer=w, **kwargs)
        except BaseException as e:  # DCP's CheckpointException (a BaseException) holds every rank's traceback
            raise _save_error(path, e) from None
        done.set_result(dict(w.fs.sums))
        return done

    def finished(f: Future) -> None:
        if f.exception() is not None:
            done.set_exception(_save_error(path, f.exception()))
        else:
            done.set_result(dict(w.fs.sums))
    dcp.async_save(sd, storage_writer=w, **kwargs).add_done_callback(finished)
    _IN_FLIGHT[trainer] = done
    return done


def _save_error(path: str, e: BaseException) -> BaseException:
    """A failed save as one line naming the checkpoint and the cause (an OSError stays one: ENOSPC, EIO)."""
    cause = cause_of(e)
    if isinstance(cause, (KeyboardInterrupt, SystemExit)):
        return cause
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return OSError(f"{path}: {type(cause).__name__}: {lines[0] if lines else repr(cause)}")


def ep_size_of(meta: dict[str, Any]) -> int:
    sizes = {int(m.group(3)) for k in meta if (m := EP_KEY.match(k)) and k.startswith("model/")}
    if len(sizes) > 1:
        raise CheckpointError(f"checkpoint mixes expert-parallel sizes {sorted(sizes)}")
    return sizes.pop() if sizes else 1


def _check(trainer, meta: dict[str, Any], path: str) -> dict[str, Any]:
    """The metadata entries this rank loads; CheckpointError (naming key and shapes) if incompatible."""
    shards = expert_shards(trainer.model)
    ours = max([w for _, w in shards.values()], default=1)
    theirs = ep_size_of(meta)
    if ours != theirs:
        raise CheckpointError(f"{path}: saved with expert-parallel size {theirs}, this trainer has {ours}")
    wanted = {}
    for name, t in trainer.model.state_dict().items():
        key = f"model/{_key(name, shards)}"
        if key not in meta:
            raise CheckpointError(f"{path}: checkpoint has no {key!r} (another model architecture?)")
        m = meta[key]
        if tuple(m.size) != tuple(t.shape) or m.properties.dtype != t.dtype:
            raise CheckpointError(f"{path}: {key!r} is {list(m.size)} {m.properties.dtype} in the checkpoint, "
                                  f"{list(t.shape)} {t.dtype} in this model (another model architecture?)")
        wanted[key] = m
    ours_model = {f"model/{_key(n, shards)}" for n in trainer.model.state_dict()}
    extra = sorted(k for k in meta if k.startswith("model/") and not EP_KEY.match(k) and k not in ours_model)
    if extra:
        raise CheckpointError(f"{path}: checkpoint has tensors this model lacks: {', '.join(extra[:5])}"
                              + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else ""))
    for key, p in _param_keys(trainer):
        for s in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
            k = f"optim/{key}/{s}"
            if k in meta:
                if s != "step" and tuple(meta[k].size) != tuple(p.shape):
                    raise CheckpointError(f"{path}: {k!r} is {list(meta[k].size)}, the parameter is {list(p.shape)}")
                wanted[k] = meta[k]
    for k in _JSON_KEYS:
        if k not in meta:
            raise CheckpointError(f"{path}: checkpoint has no {k!r} (not a moerl trainer checkpoint?)")
        wanted[k] = meta[k]
    rank, world = _rank_world(trainer)
    wanted.update({k: meta[k] for k in (f"rng/cpu@rank{rank}of{world}", f"rng/cuda@rank{rank}of{world}") if k in meta})
    return wanted


def load_trainer_state(trainer, path: str, timeout_s: float = STORAGE_TIMEOUT_S) -> None:
    """Load the state saved by `save_trainer_state` at `path` into the trainer (every rank calls it).

    Raises CheckpointError before touching the trainer when the checkpoint does not fit it."""
    meta = read_metadata(path, timeout_s)
    wanted = _check(trainer, meta, path)
    load_trainer_state_dict(trainer, load_into(path, wanted, timeout_s))
