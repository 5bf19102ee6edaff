"""The client library is a package of its own: no module of mtpdraft.client imports the
service (its engine, torch, its telemetry), not even inside a function, or names one of its
modules for importlib. A user of the client installs none of it; and the service's `mtpdraft`
command, which loads the client's commands, would import itself through them."""

from __future__ import annotations

import ast
from pathlib import Path

import mtpdraft.client

SERVICE = "mtpdraft.service"


def _service_names(path: Path, package: str) -> list[str]:
    """Where the module at `path` (of `package`) imports the service, or names it in a
    string a program may import by (importlib)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved from the module's own package
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith(SERVICE) else []
        found += [f"{path.name}:{node.lineno}: {n}" for n in names if _is_service(n)]
    return found


def _is_service(name: str) -> bool:
    return name == SERVICE or name.startswith(SERVICE + ".")


def test_no_client_module_imports_the_service() -> None:
    root = Path(mtpdraft.client.__file__).parent
    modules = sorted(root.rglob("*.py"))
    assert len(modules) > 20 and any(p.parent.name == "loadtest" for p in modules)
    found = []
    for path in modules:
        folder = path.parent.relative_to(root).parts
        found += _service_names(path, ".".join(("mtpdraft", "client", *folder)))
    assert not found, found


def test_an_import_of_the_service_is_found(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    for source in (
        "def f():\n    from mtpdraft.service.telemetry import providers_from_env\n",
        "import mtpdraft.service\n",
        "from ...service import cli\n",  # from mtpdraft.client.loadtest
        "importlib.import_module('mtpdraft.service.cli')\n",
    ):
        module.write_text(source)
        assert _service_names(module, "mtpdraft.client.loadtest"), source
    module.write_text("from ..client import errors\nfrom .servicer import x\n")
    assert not _service_names(module, "mtpdraft.client.loadtest")
