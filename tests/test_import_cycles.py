"""No two modules of the package import each other, however indirectly: an arrow between
two rooms runs one way. Imports made only for type checking count too, since a cycle
there still says that the two are one room."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mtpdraft
import mtpdraft.client
import mtpdraft.kernels
import mtpdraft.service

PACKAGES = (mtpdraft.service, mtpdraft.kernels, mtpdraft.client)


def _modules() -> dict[str, Path]:
    """Every module of PACKAGES by its dotted name (a package by its own)."""
    found = {}
    for package in PACKAGES:
        folder = Path(package.__file__).parent
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package.__name__, *parts))] = path
    return found


def _imported(name: str, path: Path, source: str, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that module `name` (`source`, at `path`) imports, anywhere
    in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import module` imports the module; `from pkg import name`, pkg.
            named = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            out |= named or {base}
    return (out & modules.keys()) - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as the modules along it, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph[node]):
            if found := visit(nxt):
                return found
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if found := visit(node):
            return found
    return None


def test_no_module_imports_itself_through_others() -> None:
    modules = _modules()
    graph = {
        name: _imported(name, path, path.read_text(), modules) for name, path in modules.items()
    }
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"b"}}, ["b", "b"]),
    ],
)
def test_a_cycle_is_found_where_there_is_one(graph, cycle) -> None:
    assert _cycle(graph) == cycle


def test_type_checking_imports_are_arrows_too() -> None:
    """A session's module importing the engine for its annotations only (as prefill.py
    once did) is an arrow to the engine."""
    modules = _modules()
    name = "mtpdraft.service.engine.prefill"
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .engine import X\n"
    imported = _imported(name, modules[name], source, modules)
    assert imported == {"mtpdraft.service.engine.engine"}
