"""Suite-wide hooks: a record of which test is running, so that a pytest process that dies without its summary
(a C++ `_exit` in Ray's driver, the OOM killer, an `os._exit`) still names the test. `make test` reads the record
back through tests/postmortem.py when pytest fails. And a Ray temp dir of the suite's own (RAY_TMPDIR)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import traceback

_PROGRESS = os.environ.get("MOERL_TEST_PROGRESS")  # a file path; unset: nothing is recorded
_MAIN_PID = os.getpid()


def _record(line: str) -> None:
    if _PROGRESS and os.getpid() == _MAIN_PID:
        with open(_PROGRESS, "a") as f:
            f.write(f"{time.time():.3f} {line}\n")


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _record(f"start {nodeid}")


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    _record(f"end {nodeid}")


def pytest_configure(config) -> None:
    # Every Ray the suite starts without a directory of its own (a run's Ray has one: moerl/local_ray.py) keeps its
    # sessions, sockets and `ray_current_cluster` in a directory of this suite's, gone at its end: not in /tmp/ray,
    # which the other suites and runs on the machine share. Short: Ray's socket paths must fit in 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="mrt", dir="/tmp")
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = ray_tmp

    def restore() -> None:
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(ray_tmp, ignore_errors=True)

    config.add_cleanup(restore)

    # A Python-level os._exit in this process (pytest-timeout's thread method, or code under test) would end the
    # run with no summary and a lost stdout buffer: say who called it first. Forked children exit untouched.
    real_exit = os._exit

    def loud_exit(code: int) -> None:
        if os.getpid() == _MAIN_PID:
            capture = config.pluginmanager.getplugin("capturemanager")
            if capture is not None:  # the test's stderr goes to a capture file that this exit would drop
                capture.suspend_global_capture(in_=False)
            sys.stderr.write(f"os._exit({code}) in the pytest process, called from:\n"
                             + "".join(traceback.format_stack(limit=12)))
            sys.stderr.flush()
            _record(f"os._exit {code}")
        real_exit(code)

    os._exit = loud_exit
    config.add_cleanup(lambda: setattr(os, "_exit", real_exit))
