"""Checkpoints of a run: the trainer ranks' state (DCP, asynchronous) and the controller's state, committed last.

    save(step):  the controller encodes its own state (queue with leased and partial tasks, ready groups,
                 version, data cursor, counters) and asks the trainer ranks to stage theirs (rank 0 clears the
                 step directory in its upload thread, then every rank uploads in the background: training
                 goes on); a job in a daemon thread then waits for the uploads, writes the controller's state,
                 the architecture and the serving files, checks that the trainer's files hold every byte their
                 metadata names, writes the COMMIT marker, then `latest`, then prunes to the newest `keep`.
                 With `hf_export`, the job then writes the committed policy as a Hugging Face directory,
                 `<hf_export>/step-NNNNNNNN` (moerl export's path: read back, verified), keeping the newest `keep`.
    poll():      reports a finished job (committed, or failed); never blocks.
    restore():   a committed step: trainer state into every rank, controller state returned.
    close():     before ray.shutdown(): the job makes no Ray call after it (a save still uploading fails, uncommitted).

No storage call runs on the controller's thread (a black-hole S3 endpoint froze the run at a save, and SIGTERM
could not stop it): each has a deadline (`storage_timeout_s`) and the job's thread is a daemon. A checkpoint whose
job failed has no COMMIT and is ignored: the previous one stays `latest`. `on_event(kind, text)` hears of each
commit ("checkpoint") and each failed save ("warning"); without it a failed save is printed.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from concurrent.futures import Future
from typing import Callable

import ray

from moerl.actors.pools import RayTrainerGroup, TrainerLost, trainer_lost
from moerl.checkpoint import (
    CONTROLLER_FILE, SERVING_DIR, TRAINER_DIR, CheckpointStore, decode_controller_state, encode_controller_state,
)
from moerl.checkpoint.deadline import STORAGE_TIMEOUT_S
from moerl.checkpoint.export import ARCH_FILE, arch_bytes, export_policy
from moerl.checkpoint.storage import StepTarget, step_name
from moerl.checkpoint.untrusted import load_error
from moerl.loop.types import STATE_CLASSES
from moerl.model.config import CheckpointError, MoEModelConfig

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # Ray colours its errors' first line
_RAY_SLICE_S = 1.0  # the longest a save job's Ray call holds off close()


class Checkpointer:
    def __init__(self, root: str, keep: int, arch: MoEModelConfig, fingerprint: dict, use_async: bool = True,
                 dtype: str | None = None, timeout_s: float = 1800.0, max_failures: int = 3,
                 serving_files: dict[str, bytes] | None = None,
                 on_event: Callable[[str, str], None] | None = None,
                 storage_timeout_s: float = STORAGE_TIMEOUT_S, hf_export: str | None = None,
                 config: dict | None = None) -> None:
        self.store = CheckpointStore(root, timeout_s=storage_timeout_s)  # no storage call here: the root may not answer
        self.keep, self.arch, self.fingerprint = keep, arch, fingerprint
        self.dtype = dtype  # the run's compute dtype, recorded for `moerl export`
        self.serving_files = dict(serving_files or {})  # tokenizer files + generation_config.json, for `moerl export`
        self.use_async = use_async
        self.timeout_s, self.max_failures = timeout_s, max_failures
        self.pending: tuple[int, Future] | None = None  # (step, its job) until poll/wait hears the outcome
        self.failures = 0  # consecutive failed saves; a committed one resets it
        self.failed_total = 0
        self.committed: int | None = None  # the newest step this run committed or resumed from
        self.on_event = on_event
        self.hf_export = hf_export  # a local directory: every committed step also exported there (HF format)
        self.config = config  # the run's config (secrets masked), in every manifest: --resume compares it
        self._export_note: tuple[str, str] | None = None  # the export's outcome, said by wait() on the loop's thread
        self._exported = False
        # The job's Ray calls run under this lock, in slices of at most _RAY_SLICE_S, and none after close(): a
        # Ray call racing ray.shutdown() meets a destroyed core worker, and Ray then ends the whole process with
        # _exit(1) (the run's error line lost).
        self._ray_lock = threading.Lock()
        self._closed = False

    def save(self, step: int, trainer: RayTrainerGroup, controller_state: dict) -> None:
        """Start saving `step`. A save that fails is counted and training goes on (the next interval tries
        again); `max_failures` in a row raise CheckpointError. A dead trainer rank is not a storage fault."""
        self.wait()  # one save at a time: the previous one's outcome first (its job is bounded)
        try:
            blobs = {CONTROLLER_FILE: encode_controller_state(controller_state, classes=STATE_CLASSES),
                     ARCH_FILE: arch_bytes(self.arch, self.dtype),
                     **{f"{SERVING_DIR}/{name}": data for name, data in self.serving_files.items()}}
            target = StepTarget(self.store.root, step, self.store.timeout_s)
            trainer.save_state(f"{self.store.step_path(step)}/{TRAINER_DIR}", self.use_async, target)
            refs = trainer.save_done()
        except TrainerLost:
            raise
        except Exception as e:  # noqa: BLE001 - storage faults: named, counted, training goes on
            self._failed(step, e)
            return
        samples = controller_state.get("counters", {}).get("samples_trained")  # said by --resume
        self.pending = (step, _in_background(lambda: self._finish(step, blobs, refs, samples)))
        if not self.use_async:
            self.wait()

    def _finish(self, step: int, blobs: dict[str, bytes], refs: list, samples: int | None = None) -> int:
        """The job (its own thread): the uploads, then this process's files, the commit and the pruning."""
        # each rank hashed its files while writing them: the manifest takes those, never a re-read
        ranks = self._gather(refs) if refs else []
        for name, data in blobs.items():  # after the uploads: rank 0 cleared the step directory before them
            self.store.write_bytes(step, name, data)
        sums = {f"{TRAINER_DIR}/{name}": crc for rank in ranks for name, crc in rank.items()}
        extra = {"fingerprint": self.fingerprint, "trained": {"samples": samples}}
        if self.config is not None:
            extra["config"] = self.config
        self.store.commit(step, extra, checksums=sums)
        self.committed = step  # at once: a run that fails before the next poll still names it
        self.store.prune(self.keep)
        if self.hf_export:
            self._export(step)
        return step

    def _gather(self, refs: list) -> list:
        """ray.get(refs) within timeout_s, in slices that close() can stop between."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._ray_lock:
                if self._closed:
                    raise CheckpointError("the run ended before the trainer's uploads finished")
                left = deadline - time.monotonic()
                if not ray.wait(refs, num_returns=len(refs), timeout=max(min(left, _RAY_SLICE_S), 0))[1]:
                    try:
                        return ray.get(refs)
                    except ray.exceptions.RayActorError as e:  # one line naming the rank, as a step's would be
                        raise trainer_lost(refs, e, "a checkpoint save") from None
            if left <= _RAY_SLICE_S:
                raise TimeoutError(f"the trainer's uploads did not finish within checkpoint.timeout_s="
                                   f"{self.timeout_s:g} s")

    def close(self) -> None:
        """No Ray call from the save job after this returns (within _RAY_SLICE_S): call it before ray.shutdown().
        A save still waiting for its uploads then fails, uncommitted; the previous checkpoint stays latest."""
        with self._ray_lock:
            self._closed = True

    def _export(self, step: int) -> None:
        """The committed step as a Hugging Face directory; a failure is a warning (the checkpoint stands)."""
        from pathlib import Path

        out = Path(self.hf_export) / step_name(step)
        try:
            if out.exists():  # a step saved again after a resume: the older export of it goes
                shutil.rmtree(out)
            lacks: list[str] = []  # said with the first export only, not at every save
            export_policy(self.store.root, str(out), step, dtype=self.dtype, timeout_s=self.store.timeout_s,
                          warn=lacks.append)
            for old in sorted(p for p in Path(self.hf_export).glob("step-*") if p.is_dir())[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
            said = self._exported
            self._exported = True
            self._export_note = ("checkpoint", f"checkpoint step {step} exported (Hugging Face) to {out}"
                                 + ("".join(f" ({text.removeprefix(f'{out}: ')})" for text in lacks) if not said
                                    else ""))
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed; only its export failed
            self._export_note = ("warning", f"checkpoint step {step} was saved but its Hugging Face export to {out} "
                                 f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def _failed(self, step: int, error: BaseException) -> None:
        self.failures += 1
        self.failed_total += 1
        where = self.store.step_path(step)
        message = f"checkpoint step {step} to {where} failed: {failure_cause(error)}{_free_space(where)}"
        if self.failures >= self.max_failures:
            raise CheckpointError(f"{message}; {self.failures} saves in a row failed (checkpoint.max_failures)")
        message += (f"; training goes on, the next save tries again "
                    f"({self.failures} of checkpoint.max_failures={self.max_failures} in a row)")
        if self.on_event is not None:
            self.on_event("warning", message)
        else:
            print(f"warning: {message}", flush=True)

    def poll(self) -> int | None:
        """The step committed by a job that finished since the last call; None while it runs (never blocks)."""
        if self.pending is None or not self.pending[1].done():
            return None
        return self.wait()

    def wait(self) -> int | None:
        """Wait for the pending save's job (at most timeout_s: a job past it is a failed save; its daemon thread
        ends with its storage calls' deadlines) and report it; returns the step committed."""
        if self.pending is None:
            return None
        step, job = self.pending
        self.pending = None
        try:
            job.result(timeout=self.timeout_s)
        except TrainerLost:
            raise  # a dead trainer rank: the run ends, naming it (not a storage fault)
        except ray.exceptions.RayActorError as e:
            raise TrainerLost(f"a trainer rank died during a checkpoint save ({type(e).__name__})") from None
        except Exception as e:  # noqa: BLE001 - an upload or a write that failed: the step stays uncommitted
            if not job.done():
                e = TimeoutError(f"the save did not finish within checkpoint.timeout_s={self.timeout_s:g} s")
            self._failed(step, e)
            return None
        self.failures = 0
        self.committed = step
        if self.on_event is not None:
            self.on_event("checkpoint", f"checkpoint step {step} saved to {self.store.step_path(step)}")
        note, self._export_note = self._export_note, None
        if note is not None:
            if self.on_event is not None:
                self.on_event(*note)
            else:
                print(f"warning: {note[1]}" if note[0] == "warning" else note[1], flush=True)
        return step

    def latest(self) -> int | None:
        """The newest step this run committed or resumed from (no storage call: the store may not answer)."""
        return self.committed

    def restore(self, trainer: RayTrainerGroup, step: int | None = None, verified: bool = False) -> tuple[int, dict]:
        """Load committed `step` (default: the newest) into every trainer rank; returns it and the controller's
        state. verified: the step was verified already (moerl/preflight.py's check_resume reads it in full).
        A checkpoint that is forged or does not fit raises CheckpointError: one line naming the file."""
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
        try:
            trainer.load_state(f"{self.store.step_path(step)}/{TRAINER_DIR}", self.store.timeout_s)
        except ray.exceptions.RayTaskError as e:  # the rank's own error in one line, not Ray's multi-line wrapper
            cause = getattr(e, "cause", None) or e
            raise CheckpointError(str(cause).splitlines()[0] if isinstance(cause, CheckpointError) else
                                  f"{self.store.step_path(step)}/{TRAINER_DIR}: cannot be loaded: {load_error(cause)}"
                                  ) from None
        where = f"{self.store.step_path(step)}/{CONTROLLER_FILE}"
        try:
            state = decode_controller_state(self.store.read_bytes(step, CONTROLLER_FILE), classes=STATE_CLASSES)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a forged or foreign file: named in one line, never a hint to unpickle it
            raise CheckpointError(f"{where}: not a controller state moerl can load: {load_error(e)}") from None
        self.committed = step
        return step, state


def failure_cause(error: BaseException) -> str:
    """A failed save in one line: "<type>: <first line>" of the error a trainer rank raised, not of Ray's wrapper
    around it (whose first line is `ray::TrainerRank.wait_save() (pid=..., actor_id=...)`): the rank's own names
    the file and the errno (ENOSPC) or the endpoint (an S3 deadline)."""
    while isinstance(error, ray.exceptions.RayTaskError) and isinstance(getattr(error, "cause", None), BaseException):
        error = error.cause
    name = type(error).__name__.removeprefix("RayTaskError(").removesuffix(")")
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    return f"{name}: {lines[0] if lines else repr(error)}"


def _in_background(fn: Callable[[], int]) -> Future:
    """fn() in a daemon thread (a job stuck on storage never holds the process at exit), as a Future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(e)
    threading.Thread(target=run, name="moerl-checkpoint", daemon=True).start()
    return future


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
