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
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_CHILD = Path(__file__).with_name("sandbox_child.py")


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


def _limits(limits: ToolLimits) -> None:
    """In the child before exec: its own session (killed as a group) and the resource limits."""
    os.setsid()
    cpu = max(1, int(limits.timeout_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb << 20,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_tool(fn: str, args: list, limits: ToolLimits, path: list[str] | None = None) -> str:
    """fn(*args)'s text, computed in a sandboxed child; ToolError naming the tool and why it failed. `path`:
    directories the child adds to sys.path (where the tool's module lives); moerl's own is always there."""
    scratch = tempfile.mkdtemp(prefix="moerl-tool-")
    root = str(Path(__file__).resolve().parents[2])
    request = json.dumps({"fn": fn, "args": list(args), "path": [root, *(path or [])]})
    cmd = [sys.executable, "-E", str(_CHILD)]
    if network_namespace():
        cmd = [shutil.which("unshare") or "unshare", "-rn", *cmd]
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=scratch, env=env, preexec_fn=lambda: _limits(limits))  # noqa: PLW1509
        try:
            out, err = proc.communicate(request.encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise ToolError(f"tool {fn} overran its {limits.timeout_s:g} s") from None
        if proc.returncode != 0:
            how = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                   else f"exit status {proc.returncode}")
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise ToolError(f"tool {fn} died ({how}) {tail[0][:200]}".rstrip())
        try:
            answer = json.loads(out.decode())
        except ValueError:
            raise ToolError(f"tool {fn} answered no JSON: {out[:100]!r}") from None
        if not isinstance(answer, dict) or not isinstance(answer.get("ok", answer.get("error")), str):
            raise ToolError(f"tool {fn} answered {str(answer)[:100]}")
        if "error" in answer:
            raise ToolError(f"tool {fn} raised {answer['error']}")
        return answer["ok"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the tool's children go too
    except ProcessLookupError:
        pass
    proc.communicate()


__all__ = ["ToolError", "ToolLimits", "network_namespace", "run_tool"]
