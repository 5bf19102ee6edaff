"""The Go module's path is one a module can `require` (a repository's path and the module's
folder in it), and every import, the proto's go_package, the example's go.mod and the offline
build use it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GO_MODULE = ROOT / "client" / "go"
GO_EXAMPLE = ROOT / "examples" / "clients" / "go"


def module_path() -> str:
    (line,) = [
        ln for ln in (GO_MODULE / "go.mod").read_text().splitlines() if ln.startswith("module ")
    ]
    return line.split()[1]


def go_imports(source: str) -> list[str]:
    """The import paths of a Go file (single imports and import blocks)."""
    blocks = re.findall(r"^import \((.*?)^\)", source, re.M | re.S)
    singles = re.findall(r'^import (?:\w+ )?"([^"]+)"', source, re.M)
    return singles + [path for block in blocks for path in re.findall(r'"([^"]+)"', block)]


def test_the_go_module_path_is_one_a_module_can_require() -> None:
    path = module_path()
    # A first element without a dot is the standard library's: `go get` and `require` refuse it.
    assert "." in path.split("/")[0], path
    # The repository's path, then the module's folder in it: where Go's lookup finds go.mod.
    assert path.endswith("/" + GO_MODULE.relative_to(ROOT).as_posix())
    polyglot = (ROOT / "client" / "polyglot.mk").read_text()
    assert re.search(rf"^PG_GO_MODULE_PATH := {re.escape(path)}$", polyglot, re.M)


def test_every_go_import_of_the_client_is_a_package_of_the_module() -> None:
    path = module_path()
    sources = [p for p in GO_MODULE.rglob("*.go") if "build" not in p.relative_to(GO_MODULE).parts]
    sources += sorted(GO_EXAMPLE.glob("*.go"))
    own = []
    for source in sources:
        for imported in go_imports(source.read_text()):
            if imported.startswith("mtpdraft"):
                raise AssertionError(f"{source}: {imported} is not under {path}")
            if imported.startswith(f"{path}/"):
                own.append(imported)
                assert (GO_MODULE / imported.removeprefix(f"{path}/")).is_dir(), imported
    assert {f"{path}/drafter", f"{path}/gen/mtpdraftv1"} <= set(own)


def test_the_proto_and_the_example_name_the_module_path() -> None:
    path = module_path()
    proto = (ROOT / "protos" / "mtpdraft" / "v1" / "drafter.proto").read_text()
    (go_package,) = re.findall(r'^option go_package = "([^"]+)";', proto, re.M)
    assert go_package == f"{path}/gen/mtpdraftv1"
    assert (GO_MODULE / "gen" / "mtpdraftv1" / "drafter.pb.go").is_file()
    example = (GO_EXAMPLE / "go.mod").read_text()
    assert re.search(rf"^require {re.escape(path)} v\S+$", example, re.M)
    (replaced,) = re.findall(rf"^replace {re.escape(path)} => (\S+)$", example, re.M)
    assert (GO_EXAMPLE / replaced).resolve() == GO_MODULE
