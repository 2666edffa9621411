"""Rendezvous stores bound to one address: a TCPStore served by this process listens on `host` only.

torch's TCPStore (and a `tcp://` init_method) listens on every interface by default, and the store has no
authentication; these keep it where its members are (127.0.0.1 on a local run). The listening socket is bound
before the store takes it, so no other process can grab a port picked in advance.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def host_store(host: str, port: int = 0, timeout_s: float = 60) -> dist.TCPStore:
    """The rendezvous store, served by this process on `host`:`port` (0: a free one, then read `store.port`).
    It listens on `host` only, not on every interface as a TCPStore does by default: the store has no
    authentication, so it is reachable only where its members are (127.0.0.1 on a local run)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    bound = sock.getsockname()[1]
    return dist.TCPStore(host, bound, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=sock.detach())  # the store owns the listening socket from here


def connect_store(host: str, port: int, timeout_s: float = 60) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s), wait_for_workers=False)
