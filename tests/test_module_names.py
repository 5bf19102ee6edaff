"""pytest imports test modules and helpers by basename (tests/ has no packages), and the
bench tests put bench/ on the path: one name in two places makes a collection error or
imports the wrong module."""

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_test_modules_have_unique_basenames():
    names = Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1]


def test_helpers_have_unique_basenames():
    """Every folder of tests/ is on the path: `import helper` takes whichever comes first."""
    names = Counter(p.name for p in (ROOT / "tests").rglob("*.py") if p.name != "conftest.py")
    assert not [n for n, c in names.items() if c > 1]


def test_bench_modules_share_no_name_with_test_helpers():
    helpers = {p.name for p in (ROOT / "tests").rglob("*.py")}
    assert not helpers & {p.name for p in (ROOT / "bench").glob("*.py")}
