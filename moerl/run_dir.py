"""One run owns its run directory: `<run.dir>/moerl.lock`, held from the checks before Ray to the run's end; and
its local checkpoint directory likewise (`<checkpoint.dir>/moerl.lock`: two runs of different run.dir must not
save into one checkpoint.dir, each pruning the other's steps).

    lock = RunLock(run_dir).acquire()   # PreflightError (one line, the holder's pid, host and start) if in use
    ...
    lock.release()                      # or `with RunLock(run_dir):`

Two runs in one directory interleaved their logs and both exited 0. The lock file holds the owner's pid, host,
start time and its process's start tick (so a recycled pid is not taken for the owner), and the owner keeps an
flock on it: the kernel drops that when the process dies, however it dies. So:

- a new lock appears whole and already flocked: it is written to a temporary file, flocked, then linked into
  place (`link` fails if the name exists: atomic, as O_EXCL);
- a lock file that exists and is flocked is in use: refused, naming the holder;
- one nobody flocks was left by a run that crashed (or was cut short while being written). It is taken over when
  its owner is gone on this host (or it names no owner), under the flock, so two runs cannot both take it over.
  An owner on another host cannot be checked from here (a shared filesystem may not carry flocks between
  hosts): refused, naming the file to delete once that run is over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import uuid
from pathlib import Path

from moerl.preflight import PreflightError

LOCK_FILE = "moerl.lock"


def proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (which may hold spaces and ')'): [0] the state, [1] the
    parent's pid, [19] the start time; None where unknown (no such process, not Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None where unknown."""
    fields = proc_stat(pid)
    return fields[19] if fields else None


def process_alive(pid: int, proc_start: str | None) -> bool:
    """Whether `pid` runs on this host and is the process that wrote the lock (same start tick, when known)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return proc_start is None or process_start(pid) in (None, proc_start)


class RunLock:
    def __init__(self, run_dir: str | Path, key: str = "run.dir") -> None:
        """key: the config key the directory comes from, as messages name it (run.dir, checkpoint.dir)."""
        self.run_dir = Path(run_dir)
        self.key = key
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self.took_over: str | None = None  # what was taken over, to be said: "the lock of pid N ..., which ..."

    def _record(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "proc_start": process_start(os.getpid()),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode()

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # another run may create or release it between two of these calls: look again
            if self._create():
                return self
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                continue  # released meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise PreflightError(f"{self.key} {str(self.run_dir)!r} is in use by another run: {_who(holder)} "
                                     f"(its lock {self.path}): wait for it to end, or choose another --{self.key}"
                                     ) from None
            try:  # the flock is ours: is it still the file at that name (not one a run released meanwhile)?
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            self._take_over(fd)
            return self
        raise PreflightError(f"{self.key} {str(self.run_dir)!r}: could not take its lock {self.path} (other runs keep "
                             "creating and releasing it)")

    def _create(self) -> bool:
        """A new lock file, whole and flocked before it has its name; False if the name is taken."""
        tmp = self.run_dir / f".{LOCK_FILE}.{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, self._record())
            os.fsync(fd)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                os.close(fd)
                return False
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        self._fd = fd
        return True

    def _take_over(self, fd: int) -> None:
        """`fd`'s flock is ours: take the lock over if its owner is gone, else refuse."""
        holder = _read(fd)
        pid, host = holder.get("pid"), holder.get("host")
        if isinstance(pid, int) and host == socket.gethostname() and process_alive(pid, holder.get("proc_start")):
            os.close(fd)  # alive without its flock (a filesystem without flocks?): never take a live run's lock
            raise PreflightError(f"{self.key} {str(self.run_dir)!r} is in use by another run: {_who(holder)} (its lock "
                                 f"{self.path}): wait for it to end, or choose another --{self.key}")
        if isinstance(pid, int) and host != socket.gethostname():
            os.close(fd)
            raise PreflightError(f"{self.key} {str(self.run_dir)!r} is locked by {_who(holder)}, which moerl cannot "
                                 f"tell from here is over: once it is, delete {self.path}")
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._record(), 0)
        os.fsync(fd)
        self._fd = fd
        self.took_over = (f"the lock of {_who(holder)}, which no longer runs" if isinstance(pid, int) else
                          "a lock file that names no run (cut short while being written)")

    def release(self) -> None:
        """Remove the lock file, then drop the flock (in that order: a run waiting for it finds no file, or a
        file of its own). Idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except OSError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _who(holder: dict) -> str:
    if not isinstance(holder.get("pid"), int):
        return "a run whose lock file names no owner yet"
    return f"pid {holder['pid']} on {holder.get('host', '?')} since {holder.get('started', '?')}"
