"""A private local Ray (no `ray.address`): confined to loopback, behind a token of its own run.

    loopback_env(local=True)            # before Ray is imported: token auth, and 127.0.0.1 as the node's address
    token = RunToken(); token.open()    # just before ray.init: a fresh token, in a 0600 file
    ...
    ray.shutdown(); token.close()       # the file and its directory are gone

Ray takes the address a node listens on from its node IP, and `ray.init(_node_ip_address="127.0.0.1")` does not
hold: Ray swaps a loopback address for the host's routed one. Its own switch for single-machine Ray
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when Ray is imported) makes 127.0.0.1 the node's address; then its
GCS, raylet, object manager, agents and workers listen on loopback only (tests/integration/test_local_security.py
lists every listener of a run). A caller that imported Ray before (a notebook, the in-process tests) keeps its own
settings: Ray then listens on every interface, behind its token when RAY_AUTH_MODE=token.

The token: Ray would write ~/.ray/auth_token world-readable (0644), shared by every run of the user and kept for
ever. A local run gets its own, in a 0600 file under a private (0700) temporary directory, named to Ray's
processes by RAY_AUTH_TOKEN_PATH, and removed when the run ends. A token the environment names already
(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) is used as it is.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile

LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node address is 127.0.0.1 (ray/_private/services.py)
TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"


def loopback_env(local: bool) -> None:
    """Before Ray is imported (it reads both when imported); when the caller imported it already, its own stand."""
    if local and "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault(LOOPBACK, "0")


def _reset_ray_token_cache() -> None:
    if "ray" in sys.modules:  # Ray's token loader caches what it read: make it read the path we set (or unset)
        from ray._raylet import AuthenticationTokenLoader

        AuthenticationTokenLoader.instance().reset_cache()


class RunToken:
    """The run's own Ray token file (see the module doc); `open` and `close` may each be called any number of
    times, `close` undoing only what `open` did."""

    def __init__(self) -> None:
        self.directory: str | None = None

    @property
    def path(self) -> str | None:
        return os.path.join(self.directory, "auth_token") if self.directory else None

    def open(self) -> None:
        if self.directory is not None or os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
            return
        if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get(TOKEN_PATH):
            return  # the environment's token stands
        self.directory = tempfile.mkdtemp(prefix="moerl-ray-")  # 0700
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        os.environ[TOKEN_PATH] = self.path  # Ray's processes inherit it from this one
        _reset_ray_token_cache()

    def close(self) -> None:
        if self.directory is None:
            return
        if os.environ.get(TOKEN_PATH) == self.path:
            del os.environ[TOKEN_PATH]
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None
        _reset_ray_token_cache()
