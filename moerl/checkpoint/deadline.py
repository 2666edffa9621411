"""Every storage call has a deadline (`checkpoint.storage_timeout_s`).

An S3 endpoint that accepts connections and never answers froze a run for 9+ minutes at a save (botocore's and
s3fs's retries multiply to ~30 minutes per call), and the thread that waited on it was joined at exit, so the
process never ended. Two layers:

    client    botocore's connect/read timeouts and attempts (and s3fs's own retry loop cut to one pass), so that
              a stuck call ends by itself within the deadline (`fs_options`, `bound_fs`)
    caller    `call` runs the operation in a daemon thread and gives up at the deadline with a one-line
              StorageTimeout naming the endpoint; a daemon thread never holds the process at exit
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, TypeVar

from moerl.model.config import CheckpointError

STORAGE_TIMEOUT_S = 60.0
_ATTEMPTS = 2  # botocore attempts per call (standard mode: a lost connection is tried once more)
T = TypeVar("T")


class StorageTimeout(CheckpointError):
    """A storage call did not answer within its deadline."""


def is_s3(url: str) -> bool:
    return url.startswith(("s3://", "s3a://"))


def endpoint(url: str) -> str:
    """Where the calls for `url` go, as messages name it (never a credential: only the endpoint's URL)."""
    if not is_s3(url):
        return "the local filesystem"
    return "S3 endpoint " + (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
                             or "of AWS (no AWS_ENDPOINT_URL)")


def fs_options(url: str, timeout_s: float) -> dict[str, Any]:
    """fsspec options for `url` so that one call, retries included, ends within about `timeout_s`."""
    if not is_s3(url):
        return {}
    connect = min(10.0, timeout_s / 4)
    read = max(1.0, timeout_s / _ATTEMPTS - connect)  # attempts x (connect + read) <= timeout_s
    return {"config_kwargs": {"connect_timeout": connect, "read_timeout": read,
                              "retries": {"max_attempts": _ATTEMPTS, "mode": "standard"}}}


def bound_fs(fs: Any) -> Any:
    """s3fs retries each call 5 times on top of botocore's attempts: once is enough (botocore retries)."""
    if hasattr(fs, "retries") and "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        fs.retries = 1
    return fs


def call(fn: Callable[..., T], *args: Any, timeout_s: float, what: str, url: str) -> T:
    """fn(*args) within `timeout_s`, else StorageTimeout: "<what> did not answer within N s (<endpoint>)". The
    call goes on in its daemon thread until the client's own timeouts end it; nobody waits for it."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="moerl-storage", daemon=True).start()
    if not done.wait(timeout_s):
        raise StorageTimeout(f"{what} did not answer within {timeout_s:g} s ({endpoint(url)}; "
                             "checkpoint.storage_timeout_s bounds each storage call)")
    if "error" in box:
        raise box["error"]
    return box["value"]
