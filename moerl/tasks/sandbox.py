"""Tool code that executes model output runs here: a child process with time, memory and file-size limits, in a
scratch directory, without network.

    text = run_tool("moerl.tasks.calculator:evaluate", ["3*(4+5)"], ToolLimits(timeout_s=5))

What is enforced, and how (docs/environments.md repeats it):
- time: RLIMIT_CPU (the child's CPU seconds) and a wall-clock deadline after which the parent kills the child's
  whole process group (a tool that sleeps or blocks has no CPU time to run out of);
- memory: RLIMIT_AS (address space); file size: RLIMIT_FSIZE; processes: a session of its own, killed as a group;
- network: a new user and network namespace (`unshare -rn`: only a loopback that is down) where unprivileged user
  namespaces are allowed (checked once per process); elsewhere Python's sockets refuse in the child, which C code
  can bypass;
- writes: the child's working directory, HOME and TMPDIR are a fresh scratch directory, removed afterwards; writes
  elsewhere are NOT prevented (no mount namespace or Landlock here): they are bounded only by RLIMIT_FSIZE and the
  user's permissions. Run rollout workers as an unprivileged user for untrusted tools.

The request and the answer are JSON (never pickle): the tool's arguments and its text result.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_CHILD = Path(__file__).with_name("sandbox_child.py")
_MAX_ANSWER = 1 << 20  # bytes of one answer: a tool's text result


class ToolError(RuntimeError):
    """The tool failed: it raised, overran its time, ran out of memory, or its process died."""


@dataclass(frozen=True)
class ToolLimits:
    timeout_s: float = 10.0  # wall clock; the CPU limit is the same number of seconds, rounded up
    memory_mb: int = 512  # address space of the child (the interpreter itself needs ~30 MB)
    file_mb: int = 16  # largest file the child may write


@functools.lru_cache(maxsize=1)
def network_namespace() -> bool:
    """Whether `unshare -rn` works here (an unprivileged user + network namespace)."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limits(limits: ToolLimits, cpu_s: int) -> None:
    """In the child before exec: its own session (killed as a group) and the resource limits."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class ToolProcess:
    """One sandboxed child serving calls one at a time. `cpu_s` bounds its CPU seconds over its whole life (a
    one-shot process gets the call's timeout; a pooled one more, and is replaced when it runs out)."""

    def __init__(self, limits: ToolLimits, path: list[str] | None = None, cpu_s: int | None = None) -> None:
        self.limits, self.path = limits, [str(Path(__file__).resolve().parents[2]), *(path or [])]
        self.scratch = tempfile.mkdtemp(prefix="moerl-tool-")
        cmd = [sys.executable, "-E", str(_CHILD)]
        if network_namespace():
            cmd = [shutil.which("unshare") or "unshare", "-rn", *cmd]
        env = {"PATH": "/usr/bin:/bin", "HOME": self.scratch, "TMPDIR": self.scratch, "LANG": "C.UTF-8"}
        cpu = cpu_s or max(1, int(limits.timeout_s + 0.999))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=self.scratch, env=env,
                                     preexec_fn=lambda: _limits(limits, cpu))  # noqa: PLW1509 - rlimits need it

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, fn: str, args: list) -> str:
        """fn(*args)'s text; ToolError naming the tool and why it failed (the process is gone after a timeout or
        a death, alive after the tool's own exception)."""
        try:
            self.proc.stdin.write((json.dumps({"fn": fn, "args": list(args), "path": self.path}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            raise self._died(fn) from None
        line, deadline = b"", time.monotonic() + self.limits.timeout_s
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                self.close()
                raise ToolError(f"tool {fn} overran its {self.limits.timeout_s:g} s")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise self._died(fn)
            line += chunk
            if len(line) > _MAX_ANSWER:
                self.close()
                raise ToolError(f"tool {fn} answered more than {_MAX_ANSWER} bytes")
        try:
            answer = json.loads(line)
        except ValueError:
            raise ToolError(f"tool {fn} answered no JSON: {line[:100]!r}") from None
        if not isinstance(answer, dict) or not isinstance(answer.get("ok", answer.get("error")), str):
            raise ToolError(f"tool {fn} answered {str(answer)[:100]}")
        if "error" in answer:
            raise ToolError(f"tool {fn} raised {answer['error']}")
        return answer["ok"]

    def _died(self, fn: str) -> ToolError:
        self.proc.stdin.close()
        err = self.proc.stderr.read(_MAX_ANSWER).decode(errors="replace").strip().splitlines()[-1:] or [""]
        code = self.proc.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        return ToolError(f"tool {fn} died ({how}) {err[0][:200]}".rstrip())

    def close(self) -> None:
        if self.alive:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the tool's children go too
            except ProcessLookupError:
                pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


class ToolPool:
    """Sandboxed processes reused across calls (a process start costs ~0.2 s on a loaded 2-core box), one call per
    process at a time, any number of callers. A pooled process serves calls of several episodes one after another:
    a tool must not keep state in its module (its scratch directory is emptied after every call)."""

    def __init__(self, limits: ToolLimits, path: list[str] | None = None, cpu_s: int = 600) -> None:
        self.limits, self.path, self.cpu_s = limits, path, cpu_s
        self._idle: list[ToolProcess] = []
        self._lock = threading.Lock()

    def run(self, fn: str, args: list) -> str:
        with self._lock:
            proc = self._idle.pop() if self._idle else None
        if proc is None or not proc.alive:
            proc = ToolProcess(self.limits, self.path, self.cpu_s)
        try:
            return proc.call(fn, args)
        finally:
            if proc.alive:
                with self._lock:
                    self._idle.append(proc)

    def close(self) -> None:
        with self._lock:
            procs, self._idle = self._idle, []
        for proc in procs:
            proc.close()


def run_tool(fn: str, args: list, limits: ToolLimits, path: list[str] | None = None) -> str:
    """fn(*args)'s text, computed in a fresh sandboxed child; ToolError naming the tool and why it failed. `path`:
    directories the child adds to sys.path (where the tool's module lives); moerl's own is always there."""
    proc = ToolProcess(limits, path)
    try:
        return proc.call(fn, args)
    finally:
        proc.close()


__all__ = ["ToolError", "ToolLimits", "ToolPool", "ToolProcess", "network_namespace", "run_tool"]
