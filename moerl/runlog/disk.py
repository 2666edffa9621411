"""Writing the run's files when the disk may be full: whole files or none, and a failure that names its file.

    replace_atomically(path, write)   write(tmp) into a temporary beside `path`, then rename it over `path`; the
                                      temporary is removed when the write fails (a full disk left zero-byte
                                      `.tmp` files behind)
    DiskWriteError(path, error, lost) one line: the file, the cause (ENOSPC and the space left there) and what the
                                      failure lost ("step 16's metrics row was not logged")
    cause_of(error, path)             that cause alone

Standard library only.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Callable


class DiskWriteError(OSError):
    """A write of the run's files failed; the message names the file, the cause and what was lost."""

    def __init__(self, path: str | Path, error: OSError, lost: str) -> None:
        super().__init__(f"writing {path} failed: {cause_of(error, path)}: {lost}")
        self.errno = error.errno


def cause_of(error: OSError, path: str | Path) -> str:
    """An OSError in words: "No space left on device (ENOSPC, 0 MiB free there)"."""
    code = errno.errorcode.get(error.errno or 0, "")
    return f"{error.strerror or error}" + (f" ({code}{free_space(path)})" if code else "")


def free_space(path: str | Path) -> str:
    """", N MiB free there" for the filesystem of `path` (its nearest existing parent), "" when unknown."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return f", {shutil.disk_usage(where).free >> 20} MiB free there"
    except OSError:
        return ""


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` then `tmp` renamed over `path` (a reader sees the old file or the new one, whole); a failed
    write removes `tmp` and raises."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
