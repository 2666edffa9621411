"""Weight sync: the trainer's newest policy to every rollout worker, publish -> transfer -> apply.

    trainer rank r (Publisher)          transfer                         rollout worker (Receiver)
    publish_items() -> bucket buffers ──shared: CUDA IPC / /dev/shm──> views on its device ──┐
    (cast once to model.dtype)        ──store: ray.put(Bucket)───────> staged device copy ───┤
                                                                 EngineThread: apply_weights()  (between decode steps)

`RayWeightSync` (sync.py) is the loop's `WeightSync` (moerl/loop/types.py): `publish(v)` queues every rank's
publish behind its current step, `deliver(wait)` hands each started worker the best form it can take, and keeps
the newest version for workers that start later (`catch_up`). Rank 0 publishes the dense tensors, the first
replica of each expert slice that slice (`model.is_expert_param`); tensors travel in flat buckets (buckets.py)
whose layout is fixed for the run.

broadcast.py is the third transport's core, for workers on other nodes: one collective per bucket from a trainer
rank to a group of workers (NCCL; gloo on the CPU), formed per generation as workers come and go, failing within a
timeout (never hanging) when a member dies. It is not wired into `RayWeightSync` yet.
"""

from moerl.actors.weight_sync.buckets import Bucket, Layout, Published, pack_bucket, plan, unpack_bucket, views
from moerl.actors.weight_sync.receiver import Receiver, apply_weights, stage
from moerl.actors.weight_sync.shared import Location

__all__ = ["Bucket", "Layout", "Location", "Published", "Receiver", "apply_weights", "pack_bucket", "plan", "stage",
           "unpack_bucket", "views"]
