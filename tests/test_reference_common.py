"""The float64 oracles and the module they share stay independent of what they check:
none imports anything of mtpdraft."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ORACLES = ("reference_common", "mtp_reference", "family_reference", "deepseek_reference")


@pytest.mark.parametrize("name", ORACLES)
def test_an_oracle_imports_nothing_of_the_service(name: str) -> None:
    imported = []
    for node in ast.walk(ast.parse((Path(__file__).parent / f"{name}.py").read_text())):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append(node.module or "")
    assert imported and not [m for m in imported if m.startswith("mtpdraft")], imported
