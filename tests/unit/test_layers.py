"""The import rules of docs/architecture.md: every package imports only the packages below it (lazy imports
inside functions included), and the loop runs without Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "moerl"

# package -> the moerl packages it may import (besides itself). Third-party imports are checked for `ray` only.
ALLOWED = {
    "kernels": set(),
    "ep": {"kernels"},
    "model": {"ep", "kernels"},
    "rollout": {"model", "ep", "kernels", "wire"},
    "checkpoint": {"model", "ep", "kernels"},
    "train": {"model", "ep", "kernels", "checks", "wire"},
    "tasks": set(),
    "loop": {"tasks", "train", "rollout", "model", "ep", "kernels", "checks", "wire"},
    "runlog": {"redact"},  # moerl/redact.py: standard library only
}
NO_RAY = {"kernels", "ep", "model", "rollout", "checkpoint", "train", "tasks", "loop", "runlog"}


def imports(path: Path) -> set[str]:
    """Every module name imported anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_is_below_it(package):
    bad = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for name in imports(path):
            parts = name.split(".")
            if parts[0] == "moerl" and len(parts) > 1 and parts[1] != package and parts[1] not in ALLOWED[package]:
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
            if package in NO_RAY and parts[0] == "ray":
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_loop_runs_without_ray_loaded():
    code = ("import sys, moerl.loop.controller, moerl.loop.samples, moerl.loop.work_queue, moerl.checkpoint; "
            "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
