"""Ray's own account of actors that have not come up: waiting for capacity, or placed and constructing.

A rollout worker that is not up yet is in one of two conditions, and they call for opposite answers:
- **waiting for capacity**: Ray holds it for a node with room (a spot node not there yet). Not a failure: the
  run trains with the workers that are up and takes this one when a node comes (moerl/actors/pools.py).
- **constructing**: a process was leased for it and its constructor runs (model load, first weights). One stuck
  here past `rollout.start_timeout_s`, or one whose constructor raises, is a failed start.

The GCS tells them apart (checked on Ray 2.60 with a slot resource and a slow constructor): an actor in
DEPENDENCIES_UNREADY, or in PENDING_CREATION with no worker process (pid 0), is waiting; PENDING_CREATION with a
pid is constructing; then ALIVE. Elapsed time alone cannot say which: 600 s of waiting for a spot node is normal,
600 s in a constructor is not. The GCS actor table is read directly (`ray._private.state`): the public
`ray.util.state` goes through the dashboard, which a moerl run does not start (`include_dashboard=False`).
"""

from __future__ import annotations

from typing import Callable, Iterable

import ray

WAITING_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION")

# (state name) -> the job's actors in that state, as ActorTableData dicts ("ActorID", "State", "Pid", ...)
ActorTable = Callable[[str], dict]


def job_actor_table(state_name: str) -> dict:
    """This job's actors in `state_name`, straight from the GCS (one call, however many actors)."""
    from ray._private import state

    job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return state.actors(job_id=job, actor_state_name=state_name)


def waiting_for_capacity(actor_ids: Iterable[str], table: ActorTable = job_actor_table) -> set[str] | None:
    """Of `actor_ids` (hex), the ones Ray holds for resources or placement (no process yet); None when the GCS
    could not be asked (the caller then falls back to elapsed time)."""
    wanted = set(actor_ids)
    if not wanted:
        return set()
    waiting = set()
    try:
        for state_name in WAITING_STATES:
            for actor_id, info in table(state_name).items():
                if actor_id in wanted and (state_name == "DEPENDENCIES_UNREADY" or not info.get("Pid")):
                    waiting.add(actor_id)
    except Exception:  # noqa: BLE001 - a GCS hiccup: no census this time, not a failed run
        return None
    return waiting


def actor_id(handle) -> str:
    return handle._actor_id.hex()
