"""Who may import whom among the repository's top-level folders: the tests take their fixtures
from ``pagedserve.testing``, never from the benchmarks (only ``tests/benchmarks``, which test the
benchmarks, import them), and no service imports the testing helpers."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICE_PACKAGES = ("pagedserve", "memory_service", "compute_service", "gateway", "kernels")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def offenders(files: list[Path], prefix: str) -> dict[str, list[str]]:
    found = {}
    for path in files:
        bad = sorted(m for m in imported_modules(path) if m == prefix or m.startswith(prefix + "."))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_tests_take_no_fixture_from_the_benchmarks() -> None:
    files = [p for p in (ROOT / "tests").rglob("*.py") if "benchmarks" not in p.relative_to(ROOT / "tests").parts]
    assert files
    assert offenders(files, "benchmarks") == {}, "import shared fixtures from pagedserve.testing"


def test_no_service_imports_the_testing_helpers_or_the_tests() -> None:
    files = [p for package in SERVICE_PACKAGES for p in (ROOT / package).rglob("*.py")
             if "testing" not in p.relative_to(ROOT).parts]
    assert files
    assert offenders(files, "pagedserve.testing") == {}
    assert offenders(files, "tests") == {}
    assert offenders(files, "benchmarks") == {}


def test_benchmarks_import_no_test() -> None:
    files = list((ROOT / "benchmarks").rglob("*.py"))
    assert files
    assert offenders(files, "tests") == {}
