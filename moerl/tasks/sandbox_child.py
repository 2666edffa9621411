"""The child side of moerl/tasks/sandbox.py, run as a script (standard library only, no moerl import): serves one
JSON request per line on stdin, {"fn": "module:function", "args": [...], "path": [...]}, calling the function in
the scratch directory (its working directory, emptied after every call) with sockets refused, and answers one
JSON line on stdout, {"ok": text} or {"error": "Type: message"}, until stdin closes."""

import importlib
import json
import os
import shutil
import socket
import sys


def _no_network(*_args, **_kwargs):
    raise PermissionError("network is disabled in the tool sandbox")


def _call(request):
    sys.path[:0] = [p for p in request.get("path", []) if isinstance(p, str) and p not in sys.path]
    module_name, _, attr = request["fn"].partition(":")
    fn = getattr(importlib.import_module(module_name), attr)
    return {"ok": str(fn(*request.get("args", [])))}


def main() -> None:
    # Best effort where no network namespace could be made: Python's sockets refuse (C code could still connect).
    socket.socket = _no_network  # type: ignore[assignment,misc]
    socket.create_connection = _no_network  # type: ignore[assignment]
    scratch = os.getcwd()
    out = sys.stdout
    sys.stdout = sys.stderr  # a tool's prints must not corrupt the answers
    for line in sys.stdin:
        try:
            result = _call(json.loads(line))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent as the tool's error
            result = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        for name in os.listdir(scratch):  # the next call starts from an empty scratch directory
            path = os.path.join(scratch, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
        out.write(json.dumps(result) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
