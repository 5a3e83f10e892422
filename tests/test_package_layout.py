"""The package's shape: modules import downward only, and the tree says where things go.

Read with ``ast``, not by importing: every import counts, including those under ``TYPE_CHECKING``
and inside functions (a lazy import is still a dependency, and a cycle hidden behind one is still
a cycle). An import of a name from a package counts as an import of that package's
``__init__``, unless the name is a submodule.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import setuptools

PACKAGE = Path(__file__).resolve().parents[1] / "kvstore"
# Lowest first: a unit may import units to its left, never one to its right.
LAYERS = [
    ["kvstore.util", "kvstore.errors", "kvstore.eviction"],
    ["kvstore.layout"],
    ["kvstore.keys", "kvstore.codecs", "kvstore.admission"],
    ["kvstore.config"],
    ["kvstore.backends", "kvstore.events"],
    ["kvstore.storage"],
    ["kvstore.sizing"],
    ["kvstore.engine"],
    ["kvstore"],  # the public API (__init__)
    ["kvstore.connectors", "kvstore.testing"],
    ["kvstore.bench"],  # what `kvstore bench` measures: it runs the connectors and starts the dev servers
    ["kvstore.cli"],
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The kvstore modules ``name`` imports, anywhere in its file."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..y import z
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else base)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def unit_of(module: str) -> str:
    """The layer unit a module belongs to: its subpackage, or itself at the top level."""
    return ".".join(module.split(".")[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_import_cycle() -> None:
    assert len(MODULES) > 40, "the walk found too few modules to mean anything"
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_cycles() -> None:
    """The check above could fail: a planted cycle, and one through a TYPE_CHECKING import, are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvstore.engine.store import KVStore\n"
    imported = {node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom) and node.module}
    assert "kvstore.engine.store" in imported


def test_subpackages_import_downward_only() -> None:
    """Each unit (a subpackage, or a top-level module) imports only units of its own layer or below."""
    rank = {unit: position for position, units in enumerate(LAYERS) for unit in units}
    units = {unit_of(module) for module in MODULES}
    assert units <= set(rank), f"units missing from LAYERS: {sorted(units - set(rank))}"
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if rank[unit_of(target)] > rank[unit_of(module)]
    )
    assert upward == []
    same_layer = {
        (unit_of(module), unit_of(target))
        for module, targets in GRAPH.items()
        for target in targets
        if unit_of(module) != unit_of(target) and rank[unit_of(target)] == rank[unit_of(module)]
    }
    # Units side by side in one layer may not lean on each other both ways.
    assert not {(a, b) for a, b in same_layer if (b, a) in same_layer}


def test_the_engine_imports_no_backend() -> None:
    """The engine is given its tiers (kvstore.storage.build_tiers makes them from a config): no module of
    kvstore.engine imports kvstore.backends, not even under TYPE_CHECKING or inside a function."""
    engine = [module for module in MODULES if unit_of(module) == "kvstore.engine"]
    assert "kvstore.engine.store" in engine and len(engine) > 5
    assert "kvstore.backends" in GRAPH["kvstore.storage.build"], "the walk must see the builder's backend import"
    reaching = sorted(
        f"{module} -> {target}"
        for module in engine
        for target in GRAPH[module]
        if unit_of(target) == "kvstore.backends"
    )
    assert reaching == []


def test_the_wheel_holds_no_research_benchmarks() -> None:
    """The package keeps what an operator runs; the benchmarks with entry points of their own live in benchmarks/.

    What setuptools packs (the pyproject's ``packages.find``) is kvstore alone; kvstore.bench holds
    only what a ``kvstore bench`` option runs (every module of it reached from kvstore.cli.bench);
    no module of the package is a command of its own (no ``__main__`` block, no argparse).
    """
    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    packed = setuptools.find_packages(str(PACKAGE.parent), **config["packages"]["find"])
    assert "kvstore.bench" in packed and (PACKAGE.parent / "benchmarks" / "eviction.py").is_file()
    assert [name for name in packed if name.split(".")[0] != "kvstore" or name == "kvstore.devtools"] == []
    reached, todo = set(), ["kvstore.cli.bench"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += GRAPH[module]
    probe = {module for module in MODULES if unit_of(module) == "kvstore.bench" and module != "kvstore.bench"}
    assert {"kvstore.bench.local", "kvstore.bench.accuracy"} <= probe
    assert sorted(probe - reached) == [], "modules of kvstore.bench that no kvstore bench option runs"
    commands = [
        name for name, path in MODULES.items() if re.search(r"__main__|^import argparse", path.read_text(), re.M)
    ]
    assert commands == []


def test_top_level_holds_few_plain_modules() -> None:
    """Everything else lives in a subpackage whose name says what it is."""
    plain = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(plain) <= 6, plain


@pytest.mark.parametrize("statement", ["import kvstore, kvstore.testing", "import kvstore.cli"])
def test_package_imports_in_a_fresh_interpreter(statement: str) -> None:
    result = subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
