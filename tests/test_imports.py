"""Who may import whom among the repository's top-level folders: the tests take their fixtures
from ``pagedserve_testing``, never from the benchmarks (only ``tests/benchmarks``, which test the
benchmarks, import them), no service imports the testing helpers, and the ground floor (``pagedserve``)
imports nothing above it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICE_PACKAGES = ("pagedserve", "memory_service", "compute_service", "gateway", "kernels")
# What stands on the ground floor: the services, the kernels, and what is built on them (the command
# line with ``up``, the test kit), the benchmarks and the tests.
ABOVE_THE_GROUND_FLOOR = ("memory_service", "compute_service", "gateway", "pagedserve_kernels", "pagedserve_cli",
                          "pagedserve_testing", "benchmarks", "tests")


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
    assert offenders(files, "benchmarks") == {}, "import shared fixtures from pagedserve_testing"


def test_no_service_imports_the_testing_helpers_or_the_tests() -> None:
    files = [p for package in SERVICE_PACKAGES for p in (ROOT / package).rglob("*.py")]
    assert files
    assert offenders(files, "pagedserve_testing") == {}
    assert offenders(files, "pagedserve_cli") == {}
    assert offenders(files, "tests") == {}
    assert offenders(files, "benchmarks") == {}


def test_the_ground_floor_imports_nothing_above_it() -> None:
    """``pagedserve`` is what every service stands on, so it imports none of them, nor anything built on
    them, not even inside a function: it starts the services as processes, by module name
    (pagedserve/stack.py). Before, ``pagedserve up`` and the test kit lived here and imported the
    services' configs."""
    files = list((ROOT / "pagedserve").rglob("*.py"))
    assert files
    found = {above: bad for above in ABOVE_THE_GROUND_FLOOR if (bad := offenders(files, above))}
    assert found == {}


def test_benchmarks_import_no_test() -> None:
    files = list((ROOT / "benchmarks").rglob("*.py"))
    assert files
    assert offenders(files, "tests") == {}


def _gateway_graph() -> dict[str, set[str]]:
    """Each gateway module's imports of other gateway modules (``from gateway.x import y`` counts
    ``gateway.x.y`` when that is a module)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (ROOT / "gateway").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_the_gateway_has_no_import_circle() -> None:
    """openai_api's constraints and convert imported each other (worked around
    inside a function); no module of the gateway may reach itself again."""
    graph = _gateway_graph()
    assert "gateway.core.service" in graph and "gateway.grpc.servicer" in graph

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for dep in graph[start] - seen:
            seen.add(dep)
            if dep == target or reaches(dep, target, seen):
                return True
        return False

    assert [m for m in sorted(graph) if reaches(m, m, set())] == []


def test_the_gateway_core_imports_no_adapter_and_no_front() -> None:
    """The core stands on its ports (gateway/core/ports.py): the backends, the tokenizer and the
    fronts are wired in by the composition root (gateway/server.py), never imported by the core."""
    files = list((ROOT / "gateway" / "core").glob("*.py"))
    assert files
    for outside in ("gateway.backend", "gateway.grpc", "gateway.openai_api", "gateway.server", "grpc"):
        assert offenders(files, outside) == {}, outside


def test_the_gateway_core_and_the_http_front_know_no_protobuf() -> None:
    """The core is plain dataclasses; the fronts convert at their edge, and the compute service's
    messages are converted where the dispatcher calls it (gateway/backend/compute_convert.py)."""
    files = [*(ROOT / "gateway" / "core").glob("*.py"), *(ROOT / "gateway" / "openai_api").glob("*.py")]
    assert offenders(files, "pagedserve.gateway") == {} and offenders(files, "pagedserve.compute") == {}
    assert offenders(files, "google.protobuf") == {}


def test_entry_points_and_the_memory_service_import_no_torch() -> None:
    """Importing torch costs seconds of CPU, paid at every process start: ``pagedserve up`` (the
    supervisor), every service's flag parsing (--help, a bad flag) and the whole memory service (the
    CPU pool is bytes to it) never import it; the compute service imports it only to serve. Before:
    compute_service.__main__ (through EngineConfig's dtype check) and the memory service's pool did."""
    code = ("import sys, pagedserve.cli, pagedserve_cli.cli, pagedserve_cli.up, compute_service.__main__, "
            "memory_service.__main__, memory_service.service.server, gateway.__main__; "
            "print(sorted(m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
