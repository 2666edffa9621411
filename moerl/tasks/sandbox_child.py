"""The child side of moerl/tasks/sandbox.py, run as a script (standard library only, no moerl import): reads one
JSON request {"fn": "module:function", "args": [...], "path": [...]} on stdin, calls the function in the scratch
directory with sockets refused, and writes {"ok": text} or {"error": "Type: message"} on stdout."""

import importlib
import json
import socket
import sys


def _no_network(*_args, **_kwargs):
    raise PermissionError("network is disabled in the tool sandbox")


def main() -> None:
    request = json.loads(sys.stdin.read())
    # Best effort where no network namespace could be made: Python's sockets refuse (C code could still connect).
    socket.socket = _no_network  # type: ignore[assignment,misc]
    socket.create_connection = _no_network  # type: ignore[assignment]
    sys.path[:0] = [p for p in request.get("path", []) if isinstance(p, str)]
    try:
        module_name, _, attr = request["fn"].partition(":")
        fn = getattr(importlib.import_module(module_name), attr)
        result = {"ok": str(fn(*request.get("args", [])))}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as the tool's error
        result = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    sys.stdout.write(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
