"""pagedserve.cpu_preload: which environment a CPU compute process is re-executed with."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve import cpu_preload


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    """A venv-like prefix holding both libraries (empty files: only their paths are used here)."""
    (tmp_path / "lib").mkdir()
    for name in ("libiomp5.so", "libtcmalloc_minimal.so.4"):
        (tmp_path / "lib" / name).write_bytes(b"")
    return tmp_path


def test_both_libraries_are_preloaded_ahead_of_what_was_there(prefix: Path) -> None:
    env = cpu_preload.preload_env({"LD_PRELOAD": "/x/libother.so", "HOME": "/h"}, prefix=str(prefix))
    lib = prefix / "lib"
    assert env["LD_PRELOAD"].split(":") == [str(lib / "libtcmalloc_minimal.so.4"), str(lib / "libiomp5.so"),
                                            "/x/libother.so"]
    assert env["HOME"] == "/h" and "KMP_AFFINITY" not in env  # no pinning unless asked
    assert cpu_preload.preload_env(env, prefix=str(prefix)) is None  # once: the re-executed process stops


def test_off_or_without_intel_openmp_changes_nothing(prefix: Path, monkeypatch) -> None:
    assert cpu_preload.preload_env({"PAGEDSERVE_CPU_PRELOAD": "0"}, prefix=str(prefix)) is None
    monkeypatch.setattr(cpu_preload, "_SYSTEM_DIRS", ())  # only the prefix's libraries
    (prefix / "lib" / "libtcmalloc_minimal.so.4").unlink()  # Intel OpenMP alone: still worth it
    assert cpu_preload.preload_env({}, prefix=str(prefix))["LD_PRELOAD"] == str(prefix / "lib" / "libiomp5.so")
    (prefix / "lib" / "libiomp5.so").unlink()
    assert cpu_preload.preload_env({}, prefix=str(prefix)) is None


def test_pinning_lists_this_process_cpus(prefix: Path) -> None:
    env = cpu_preload.preload_env({"PAGEDSERVE_CPU_PIN": "1"}, prefix=str(prefix))
    cpus = sorted(os.sched_getaffinity(0))
    assert env["KMP_AFFINITY"] == f"granularity=fine,explicit,proclist=[{','.join(map(str, cpus))}]"
    assert env["OMP_NUM_THREADS"] == str(len(cpus))


def test_reexec_keeps_the_pid_and_runs_once(tmp_path: Path) -> None:
    """A real re-exec of a tiny module: same pid before and after, the marker set, no loop."""
    module = tmp_path / "probe_reexec.py"
    module.write_text(
        "import os, sys\n"
        "print('pid', os.getpid(), os.environ.get('_PAGEDSERVE_CPU_PRELOADED'), flush=True)\n"
        "from pagedserve import cpu_preload\n"
        "cpu_preload.maybe_reexec('probe_reexec')\n"
        "print('after', os.getpid(), flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parent.parent)])}
    out = subprocess.run([sys.executable, "-m", "probe_reexec"], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split("\n")
    lines = [line.split() for line in out if line]
    if cpu_preload.preload_env(dict(os.environ)) is None:  # no libraries on this machine: nothing to do
        assert [line[0] for line in lines] == ["pid", "after"]
        return
    assert [line[0] for line in lines] == ["pid", "pid", "after"]
    assert lines[0][1] == lines[1][1] == lines[2][1]  # the same process throughout
    assert lines[0][2] == "None" and "libiomp5.so" in lines[1][2]  # the marker names what was preloaded


def test_strip_env_removes_only_what_was_added(prefix: Path) -> None:
    env = cpu_preload.preload_env({"LD_PRELOAD": "/x/libother.so", "HOME": "/h"}, prefix=str(prefix))
    assert cpu_preload.strip_env(env) == {"LD_PRELOAD": "/x/libother.so", "HOME": "/h"}
    assert cpu_preload.strip_env(cpu_preload.preload_env({}, prefix=str(prefix))) == {}
    assert cpu_preload.strip_env({"LD_PRELOAD": "/y.so"}) == {"LD_PRELOAD": "/y.so"}  # not ours: kept


_RETAINING = """
import re, sys
from pagedserve import cpu_preload

def anon_mib():
    return int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024

chunks = [bytearray(8192) for _ in range(40_000)]  # 320 MiB in pieces malloc keeps for reuse once freed
pinned = bytearray(8192)  # allocated last: freed memory below it cannot shrink the heap from its top
del chunks
held = anon_mib()
allocator = cpu_preload.release_free_memory()
print(allocator, held, anon_mib())
"""


@pytest.mark.parametrize("allocator", ["glibc", "tcmalloc"])
def test_release_free_memory_returns_what_the_allocator_kept(allocator: str) -> None:
    """Memory freed inside the process (as a model's load frees its read and widened copies) is
    resident until the allocator is told to hand it back: then it is not."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if allocator == "tcmalloc":
        library = cpu_preload.find_library(cpu_preload.TCMALLOC, list(cpu_preload._SYSTEM_DIRS))
        if library is None:
            pytest.skip("no tcmalloc on this machine")
        env["LD_PRELOAD"] = library
    out = subprocess.run([sys.executable, "-c", _RETAINING], env=env, capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    assert out[0] == allocator
    held, after = int(out[1]), int(out[2])
    assert held - after >= 250, (held, after)  # of the 320 MiB freed
