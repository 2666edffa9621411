"""After a failed `make test`: if pytest died inside a test (no summary printed), name that test, how long it had
run, and the warnings of the Ray driver log written since it started (Ray's C++ core worker ends its process with
`_exit(1)` when it loses its raylet or GCS, and says why only in that log).

Usage: python tests/postmortem.py PROGRESS_FILE [RAY_TMP_DIR]
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path


def unfinished(progress: Path) -> tuple[str, float] | None:
    """The test that started and never finished, with its start time; None if every started test finished."""
    running: dict[str, float] = {}
    for line in progress.read_text().splitlines():
        stamp, event, *rest = line.split(" ", 2)
        if event == "start":
            running[rest[0]] = float(stamp)
        elif event == "end":
            running.pop(rest[0], None)
    return next(iter(running.items()), None)


def driver_log_tail(ray_tmp: Path, since: float, lines: int = 15) -> list[str]:
    # written since the test started (1 s of slack for timestamps of another clock's rounding)
    logs = [p for p in ray_tmp.glob("session_*/logs/python-core-driver-*.log") if p.stat().st_mtime >= since - 1.0]
    if not logs:
        return []
    newest = max(logs, key=lambda p: p.stat().st_mtime)
    level = re.compile(r"^\[\S+ \S+ [WEF] ")  # "[2026-12-04 15:00:06,025 W pid tid] file.cc:1: ..."
    kept = [x for x in newest.read_text(errors="replace").splitlines() if level.match(x)]
    return [f"{newest}:"] + kept[-lines:]


def main(argv: list[str]) -> int:
    progress = Path(argv[0])
    ray_tmp = Path(argv[1] if len(argv) > 1 else "/tmp/ray")
    if not progress.exists():
        return 0
    hit = unfinished(progress)
    if hit is None:
        return 0  # pytest ended normally and printed its own summary
    nodeid, started = hit
    print(f"pytest died while running {nodeid}, {time.time() - started:.0f} s after it started "
          f"(no summary: the process ended without pytest's consent)", file=sys.stderr)
    for line in driver_log_tail(ray_tmp, started):
        print(f"  {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
