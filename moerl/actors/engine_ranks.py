"""A rollout worker's engine group (rollout.ep_size = P > 1): rank 0 is the worker's own process, ranks 1..P-1
are child processes on its node, one GPU each (cuda:r of the GPUs Ray gave the worker; gloo on the CPU).

    leader = start_engine_group(spec)     # in the worker: starts the followers, joins them, builds rank 0
    EngineThread(leader)                  # drives the group as one Engine (moerl/rollout/group_leader.py)

Every rank builds or loads its model with the group as its expert-parallel group: its own experts only, the
dense layers whole. A follower exits when its parent is gone (the worker replaced or exited), so a lost worker
leaves no rank behind; a lost follower fails the leader's next round, the worker reports the error, and the
pool replaces the whole worker (its leases go back).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moerl.actors.worker_spec import rollout_model
from moerl.model import build_model, load_pretrained
from moerl.model.config import MoEModelConfig
from moerl.rendezvous import connect_store, host_store
from moerl.rollout.engine_group import EngineGroup
from moerl.rollout.group_leader import GroupLeader, follow

# The followers wait in a collective for the leader's next command, however long the worker idles (an eval
# hold, a slow trainer step): the group's timeout must not end them. Lost peers show as closed connections.
IDLE_TIMEOUT = timedelta(days=1)
# all_to_all runs on gloo and NCCL and is what the CPU tests check; symm_mem is not yet tried in the engine.
DISPATCHER = "all_to_all"
STORE_TIMEOUT_S = 600  # how long a rank waits for the others at the rendezvous (model loads come after it)


def start_engine_group(spec, start_method: str = "spawn") -> GroupLeader:
    """Start ranks 1..P-1, join them as rank 0, and return the leader over rank 0's engine."""
    size = spec.ep_size
    # The group's rendezvous store, served here and bound to loopback only (it has no authentication; a plain
    # tcp:// init would listen on every interface). Its port is taken by the store itself: no free-port race.
    store = host_store("127.0.0.1", timeout_s=STORE_TIMEOUT_S)
    ctx = mp.get_context(start_method)
    procs = [ctx.Process(target=_follower, args=(rank, size, store.port, spec, os.getpid()), daemon=True,
                         name=f"moerl-engine-rank{rank}") for rank in range(1, size)]
    for p in procs:
        p.start()
    leader = GroupLeader(rank_engine(spec, 0, size, store))
    leader.processes = procs
    return leader


def rank_engine(spec, rank: int, size: int, store: dist.Store) -> EngineGroup:
    """Join the group (rendezvous on `store`) as `rank` and build this rank's engine (its experts, the dense
    layers whole)."""
    cuda = spec.device.startswith("cuda")
    device = torch.device(f"cuda:{rank}" if cuda else spec.device)
    if cuda:  # NCCL's object collectives (the leader's commands) use the current device: this rank's own
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size,
                            timeout=IDLE_TIMEOUT, device_id=device if cuda else None)
    group, dtype = dist.group.WORLD, getattr(torch, spec.dtype)
    if spec.model_path:
        model = load_pretrained(spec.model_path, dtype=dtype, device=device, expert_parallel_group=group,
                                dispatcher=DISPATCHER)
    else:
        model = build_model(MoEModelConfig.from_hf_dict(spec.arch), dtype=dtype, device=device, seed=spec.seed,
                            expert_parallel_group=group, dispatcher=DISPATCHER)
    return EngineGroup(rollout_model(model, spec), spec.engine, group=group, version=-1)


def _follower(rank: int, size: int, port: int, spec, parent_pid: int) -> None:
    torch.set_num_threads(spec.threads)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    follow(rank_engine(spec, rank, size, connect_store("127.0.0.1", port, timeout_s=STORE_TIMEOUT_S)))
    dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    """A follower blocked in a collective would wait out IDLE_TIMEOUT: leave as soon as the worker is gone
    (os._exit in the worker skips the daemon children's clean-up)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)
