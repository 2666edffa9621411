"""Checkpoints of a run: the trainer ranks' state (DCP, asynchronous) and the controller's state, committed last.

    save(step):  trainer ranks stage their state and upload in the background (training goes on);
                 the controller writes its own state (queue with leased and partial tasks, ready groups,
                 version, data cursor, counters) and the architecture; once every rank's upload finished,
                 `poll()` writes the COMMIT marker, then `latest`, then prunes to the newest `keep`.
    restore():   the newest committed step: trainer state into every rank, controller state returned.

A checkpoint whose upload never finished has no COMMIT and is ignored: the previous one stays `latest`.
`on_event(kind, text)` hears of each commit ("checkpoint") and each failed save ("warning"); without it a
failed save is printed.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

import ray

from moerl.actors.pools import RayTrainerGroup, TrainerLost
from moerl.checkpoint import (
    CONTROLLER_FILE, SERVING_DIR, TRAINER_DIR, CheckpointStore, decode_controller_state, encode_controller_state,
    write_arch,
)
from moerl.loop.types import STATE_CLASSES
from moerl.model.config import CheckpointError, MoEModelConfig


class Checkpointer:
    def __init__(self, root: str, keep: int, arch: MoEModelConfig, fingerprint: dict, use_async: bool = True,
                 dtype: str | None = None, timeout_s: float = 1800.0, max_failures: int = 3,
                 serving_files: dict[str, bytes] | None = None,
                 on_event: Callable[[str, str], None] | None = None) -> None:
        self.store, self.keep, self.arch, self.fingerprint = CheckpointStore(root), keep, arch, fingerprint
        self.dtype = dtype  # the run's compute dtype, recorded for `moerl export`
        self.serving_files = dict(serving_files or {})  # tokenizer files + generation_config.json, for `moerl export`
        self.use_async = use_async
        self.timeout_s, self.max_failures = timeout_s, max_failures
        self.pending: tuple[int, list] | None = None  # (step, trainer save refs) awaiting commit
        self.failures = 0  # consecutive failed saves; a committed one resets it
        self.failed_total = 0
        self.on_event = on_event

    def save(self, step: int, trainer: RayTrainerGroup, controller_state: dict) -> None:
        """Start saving `step`. A save that fails is counted and training goes on (the next interval tries
        again); `max_failures` in a row raise CheckpointError. A dead trainer rank is not a storage fault."""
        self.wait()  # one upload at a time: commit the previous one first
        try:
            self.store.begin(step)
            trainer.save_state(f"{self.store.step_path(step)}/{TRAINER_DIR}", self.use_async)
            self.store.write_bytes(step, CONTROLLER_FILE,
                                   encode_controller_state(controller_state, classes=STATE_CLASSES))
            write_arch(self.store, step, self.arch, self.dtype)
            for name, data in self.serving_files.items():
                self.store.write_bytes(step, f"{SERVING_DIR}/{name}", data)
            self.pending = (step, trainer.save_done())
        except TrainerLost:
            raise
        except Exception as e:  # noqa: BLE001 - storage faults: named, counted, training goes on
            self._failed(step, e)
            return
        if not self.use_async:
            self.wait()

    def _failed(self, step: int, error: BaseException) -> None:
        self.failures += 1
        self.failed_total += 1
        cause = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        where = self.store.step_path(step)
        message = f"checkpoint step {step} to {where} failed: {type(error).__name__}: {cause}{_free_space(where)}"
        if self.failures >= self.max_failures:
            raise CheckpointError(f"{message}; {self.failures} saves in a row failed (checkpoint.max_failures)")
        message += (f"; training goes on, the next save tries again "
                    f"({self.failures} of checkpoint.max_failures={self.max_failures} in a row)")
        if self.on_event is not None:
            self.on_event("warning", message)
        else:
            print(f"warning: {message}", flush=True)

    def poll(self) -> int | None:
        """Commit the pending checkpoint if its uploads are done; returns the committed step."""
        if self.pending is None:
            return None
        ready, _ = ray.wait(self.pending[1], num_returns=len(self.pending[1]), timeout=0)
        return self.wait() if len(ready) == len(self.pending[1]) else None

    def wait(self) -> int | None:
        if self.pending is None:
            return None
        step, refs = self.pending
        self.pending = None
        try:
            # each rank hashed its files while writing them: the manifest takes those, never a re-read
            ranks = ray.get(refs, timeout=self.timeout_s)
            sums = {f"{TRAINER_DIR}/{name}": crc for rank in ranks for name, crc in rank.items()}
            self.store.commit(step, {"fingerprint": self.fingerprint}, checksums=sums)
            self.store.prune(self.keep)
        except ray.exceptions.RayActorError:
            raise  # a dead trainer rank: the run ends (pools.TrainerLost names it), not a storage fault
        except Exception as e:  # noqa: BLE001 - an upload that failed or never finished: the step stays uncommitted
            self._failed(step, e)
            return None
        self.failures = 0
        if self.on_event is not None:
            self.on_event("checkpoint", f"checkpoint step {step} saved to {self.store.step_path(step)}")
        return step

    def latest(self) -> int | None:
        return self.store.latest_step()

    def restore(self, trainer: RayTrainerGroup, step: int | None = None, verified: bool = False) -> tuple[int, dict]:
        """Load committed `step` (default: the newest) into every trainer rank; returns it and the controller's
        state. verified: the step was verified already (moerl/preflight.py's check_resume reads it in full)."""
        step = self.store.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"--resume: no committed checkpoint under {self.store.root!r}")
        if not verified:
            self.store.verify(step)  # sizes and checksums: a corrupted file stops the resume, named
        saved = self.store.read_manifest(step).get("fingerprint", {})
        mismatched = {k: (saved.get(k), v) for k, v in self.fingerprint.items() if saved.get(k) != v}
        if mismatched:
            raise ValueError(f"--resume: checkpoint step {step} was written with another configuration: "
                             + ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in mismatched.items()))
        trainer.load_state(f"{self.store.step_path(step)}/{TRAINER_DIR}")
        state = decode_controller_state(self.store.read_bytes(step, CONTROLLER_FILE), classes=STATE_CLASSES)
        return step, state


def _free_space(path: str) -> str:
    """", N MiB free on that filesystem" for a local path (ENOSPC surfaces from DCP as `enforce fail ...`)."""
    if "://" in path:
        return ""
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        return f" ({shutil.disk_usage(probe or '.').free >> 20} MiB free there)"
    except OSError:
        return ""
