"""Kernels share their common pieces openly: a kernel module imports, from this package,
only the helpers (``_shared``, ``_checks``), never another kernel, and nothing of the
service (kernels know nothing of models or states)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mtpdraft.kernels

KERNELS = Path(mtpdraft.kernels.__file__).parent
HELPERS = {"_shared", "_checks"}
MODULES = sorted(p for p in KERNELS.glob("*.py") if p.stem != "__init__")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, level) of each import in the file: level 0 absolute, 1 relative."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
        elif isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.stem)
def test_a_kernel_imports_only_the_helpers_of_this_package(path: Path) -> None:
    for module, level in _imports(path):
        if level:
            assert module in HELPERS, f"{path.name} imports .{module}"
        else:
            assert not module.startswith("mtpdraft"), f"{path.name} imports {module}"


def test_the_helpers_import_no_kernel() -> None:
    for name in HELPERS:
        for module, level in _imports(KERNELS / f"{name}.py"):
            assert not level or module in HELPERS, f"{name}.py imports .{module}"
