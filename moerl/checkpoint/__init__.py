"""Checkpoints to a local directory or S3: committed steps, trainer state through DCP, controller state, export.

    store = CheckpointStore("s3://bucket/run1")          # or a local path
    store.begin(step)                                    # clear a stale attempt at this step
    fut = save_trainer_state(trainer, f"{store.step_path(step)}/trainer", use_async=True)  # every trainer rank
    store.write_bytes(step, "controller.pt", encode_controller_state(state, classes=...)); write_arch(store, step, cfg)
    sums = fut.result()  # this rank's files, hashed while written; gather every rank's, under "trainer/"
    store.commit(step, {"fingerprint": {...}}, checksums={f"trainer/{k}": v for k, v in sums.items()}); store.prune(keep)
    step = store.latest_step(); load_trainer_state(trainer, f"{store.step_path(step)}/trainer")
"""

from moerl.checkpoint.controller_state import decode_controller_state, encode_controller_state
from moerl.checkpoint.export import (
    ARCH_FILE, SERVING_DIR, TRAINER_DIR, export_policy, export_step, read_arch, serving_files, write_arch,
)
from moerl.checkpoint.storage import CheckpointStore, step_name
from moerl.checkpoint.trainer_state import (
    load_trainer_state, load_trainer_state_dict, save_trainer_state, trainer_state_dict,
)
from moerl.model.config import CheckpointError

CONTROLLER_FILE = "controller.pt"

__all__ = [
    "ARCH_FILE", "CONTROLLER_FILE", "SERVING_DIR", "TRAINER_DIR", "CheckpointError", "CheckpointStore",
    "decode_controller_state", "encode_controller_state", "export_policy", "export_step", "load_trainer_state", "load_trainer_state_dict", "read_arch",
    "save_trainer_state", "serving_files", "step_name", "trainer_state_dict", "write_arch",
]
