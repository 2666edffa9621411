"""One-way imports (issue 36 item 3): no module of moerl imports a higher layer, and no two modules import each
other, directly or around a cycle. An import inside a function (deferred, for a fast `--help`) or under
`if TYPE_CHECKING:` counts as much as one at the top of a file: deferring may save start-up time, but only
where the import points down. `from moerl.pkg import x` is an edge to the package `moerl.pkg` (its __init__)
and, when x is a module, to `moerl.pkg.x`. Imports by a computed name (`importlib.import_module`) are not seen.

The layers, lowest first. A module may import its own layer and those below; groups that share a layer
(`a | b`) import nothing of each other.

    base            moerl, checks, redact, wire, rendezvous, config, train.config: small pieces that import no
                    other layer (config and train.config stay torch-free, so every command can read a config).
    kernels         fused ops with their torch references.
    ep              the expert-parallel dispatcher contract and its backends, over the kernels.
    model           the Qwen3-MoE policy (layers, MoE block, Hugging Face I/O), over ep and kernels.
    rollout | train | tasks
                    the parts a run is built from, none needing another: the inference engine, the loss and one
                    trainer rank, the prompt sources with their rewards.
    loop | checkpoint | runlog
                    the RL loop over those parts (no Ray: it drives pools, checkpoints and the run log through
                    the Protocols and callbacks that run.py fills), what a run saves, and what it shows.
    actors          the Ray side: trainer ranks, rollout workers, pools, weight sync, checkpoint scheduling.
    run             the composition root (run.py) and what only it uses before and around a run: preflight,
                    resume, run_dir, local_ray, ray_gc.
    train command   `moerl train` as a command (train_cli: exit codes, the lines a user sees) and its
                    arguments (train_args, which also answers `moerl train --help` before torch loads).
    launch | bench  `moerl launch` (its pods run `moerl train`) and the benchmarks (some drive a whole run).
    cli             `moerl` itself: picks the command and imports it lazily.

tests/unit/test_layers.py holds the finer rules of the lower packages (what each of them may import, and no Ray
below the actors). A new module fails `test_every_module_has_a_layer` until it is placed in LAYERS below.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "moerl"

# Lowest first: layer -> its groups (independent of each other) -> the names in each group. A name covers the
# module of that name and, for a package other than the root `moerl`, every module under it; the most specific
# name wins (moerl.train.config is base, the rest of moerl.train is not).
LAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "base": (("moerl", "moerl.checks", "moerl.redact", "moerl.wire", "moerl.rendezvous", "moerl.config",
              "moerl.config_loader", "moerl.config_docs", "moerl.train.config", "moerl.startup"),),
    "kernels": (("moerl.kernels",),),
    "ep": (("moerl.ep",),),
    "model": (("moerl.model",),),
    "rollout | train | tasks": (("moerl.rollout",), ("moerl.train",), ("moerl.tasks",)),
    "loop | checkpoint | runlog": (("moerl.loop",), ("moerl.checkpoint",), ("moerl.runlog",)),
    "actors": (("moerl.actors",),),
    "run": (("moerl.run", "moerl.preflight", "moerl.resume", "moerl.run_dir", "moerl.local_ray", "moerl.ray_gc"),),
    "train command": (("moerl.train_cli", "moerl.train_args"),),
    "launch | bench": (("moerl.launch",), ("moerl.bench",)),
    "cli": (("moerl.cli",),),
}

Edges = dict[str, dict[str, int]]  # module -> module it imports -> the line of the first such import


def module_files(root: Path) -> dict[str, Path]:
    """Every module under the package directory `root`, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path) -> tuple[dict[str, Path], Edges]:
    """The modules under `root` and which of them each imports, anywhere in its file."""
    files = module_files(root)
    edges: Edges = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = edges.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package):
                if target in files and target != name:
                    found.setdefault(target, node.lineno)
    return files, edges


def _targets(node: ast.AST, package: list[str]) -> Iterable[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    # `from .x import y` in module a.b.c (package a.b): level 1 is a.b, level 2 is a
    base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
    module = ".".join(p for p in (base, node.module or "") if p)
    return [module, *(f"{module}.{alias.name}" for alias in node.names)]


def cycles(edges: Edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def place(module: str) -> tuple[int, int, str] | None:
    """(layer index, group index, layer name) of `module`: its own entry, else its nearest listed package."""
    entries = {name: (i, g, layer) for i, (layer, groups) in enumerate(LAYERS.items())
               for g, group in enumerate(groups) for name in group}
    parts = module.split(".")
    for n in range(len(parts), 1, -1):  # the root `moerl` covers only itself
        if ".".join(parts[:n]) in entries:
            return entries[".".join(parts[:n])]
    return entries.get(module)


def _where(files: dict[str, Path], module: str, line: int) -> str:
    return f"{files[module].relative_to(PACKAGE.parent)}:{line}"


def test_every_module_has_a_layer() -> None:
    files, _ = import_graph(PACKAGE)
    unplaced = [m for m in files if place(m) is None]
    assert not unplaced, f"modules in no layer (add each to LAYERS in {Path(__file__).name}): {unplaced}"


def test_no_two_modules_import_each_other() -> None:
    files, edges = import_graph(PACKAGE)
    lines = []
    for component in cycles(edges):
        lines.append("cycle: " + ", ".join(component))
        lines += [f"  {a} -> {b} ({_where(files, a, line)})" for a in component
                  for b, line in sorted(edges[a].items()) if b in component]
    assert not lines, "imports that run in a circle (move the shared piece down into a module both import):\n" + \
        "\n".join(lines)


def test_no_module_imports_a_higher_layer_or_a_sibling() -> None:
    files, edges = import_graph(PACKAGE)
    bad = []
    for a, targets in sorted(edges.items()):
        for b, line in sorted(targets.items()):
            pa, pb = place(a), place(b)
            if pa is None or pb is None:
                continue  # test_every_module_has_a_layer names it
            if pb[0] > pa[0]:
                bad.append(f"{a} ({pa[2]}) imports {b} ({pb[2]}), a higher layer, at {_where(files, a, line)}")
            elif pb[0] == pa[0] and pb[1] != pa[1]:
                bad.append(f"{a} imports {b}, an independent group of the layer {pa[2]}, at {_where(files, a, line)}")
    assert not bad, "imports against the layers (module docstring of this test):\n" + "\n".join(bad)


def test_the_graph_counts_deferred_relative_and_type_checking_imports(tmp_path: Path) -> None:
    """The checker itself, on a package made here: every kind of import it must see."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from pkg.sub import high\n")  # deferred, and a package + module
    (pkg / "sub" / "__init__.py").write_text("from . import high\n")  # relative, from a package's __init__
    (pkg / "sub" / "high.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from ..low import f\nimport os\n")  # relative, two levels up
    files, edges = import_graph(pkg)
    assert sorted(files) == ["pkg", "pkg.low", "pkg.sub", "pkg.sub.high"]
    assert edges == {"pkg": {}, "pkg.low": {"pkg.sub": 2, "pkg.sub.high": 2}, "pkg.sub": {"pkg.sub.high": 1},
                     "pkg.sub.high": {"pkg.low": 3}}
    assert cycles(edges) == [["pkg.low", "pkg.sub", "pkg.sub.high"]]
