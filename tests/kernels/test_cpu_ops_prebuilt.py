"""Prebuilt fused CPU kernels (what the container image ships): the best portable level this CPU runs
is loaded from $PAGEDSERVE_CPU_OPS_PREBUILT, and a missing build says so before building here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_ops

ROOT = Path(__file__).resolve().parents[2]
V3 = "fpu sse2 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"


def test_levels_follow_the_cpu_flags(monkeypatch) -> None:
    monkeypatch.setattr(cpu_ops.platform, "machine", lambda: "x86_64")
    assert cpu_ops.supported_levels(f"flags : {V3} avx512f avx512bw avx512cd avx512dq avx512vl") == [
        "x86-64-v4", "x86-64-v3"]
    assert cpu_ops.supported_levels(f"flags : {V3} avx512f") == ["x86-64-v3"]  # AVX-512 F alone is not v4
    assert cpu_ops.supported_levels(f"flags : {V3}".replace(" avx2", "")) == []
    monkeypatch.setattr(cpu_ops.platform, "machine", lambda: "aarch64")
    assert cpu_ops.supported_levels(f"flags : {V3}") == []


def test_portable_builds_do_not_depend_on_this_cpu(monkeypatch) -> None:
    key = cpu_ops.build_dir("x86-64-v3", Path("/p"))
    monkeypatch.setattr(cpu_ops, "_cpu_flags", lambda: "flags : another cpu")
    assert cpu_ops.build_dir("x86-64-v3", Path("/p")) == key
    assert key.name.startswith(f"{cpu_ops.platform.machine()}-x86-64-v3-")
    assert "-march=x86-64-v3" in cpu_ops._cflags("x86-64-v3") and "-march=native" in cpu_ops._cflags("native")


def test_prebuild_refuses_an_unknown_level(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--level"):
        cpu_ops.prebuild(tmp_path, ["native"])


def _report(env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m kernels.cpu_ops` in a fresh process (a library loads once per process)."""
    return subprocess.run([sys.executable, "-m", "kernels.cpu_ops"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.mark.skipif(cpu_ops.load() is None or not cpu_ops.supported_levels(),
                    reason="needs this machine's build of the fused CPU kernels on x86-64")
def test_the_best_prebuilt_level_is_loaded(tmp_path: Path) -> None:
    """This machine's own build stands in for a prebuilt library: only where it is found differs."""
    library = cpu_ops.build_dir() / "pagedserve_cpu_ops.so"
    best = cpu_ops.supported_levels()[0]
    for level in cpu_ops.supported_levels():
        target = cpu_ops.build_dir(level, tmp_path) / "pagedserve_cpu_ops.so"
        target.parent.mkdir(parents=True)
        shutil.copy(library, target)
    done = _report({"PAGEDSERVE_CPU_OPS_PREBUILT": str(tmp_path)})
    assert f"fused CPU kernels: prebuilt {best} in {cpu_ops.build_dir(best, tmp_path)}" in done.stdout, done
    assert cpu_ops.prebuild(tmp_path, [best]) == [cpu_ops.build_dir(best, tmp_path) / "pagedserve_cpu_ops.so"]


@pytest.mark.skipif(cpu_ops.load() is None, reason="needs this machine's build of the fused CPU kernels")
def test_a_missing_prebuilt_build_is_not_silent(tmp_path: Path) -> None:
    done = _report({"PAGEDSERVE_CPU_OPS_PREBUILT": str(tmp_path)})
    assert f"no prebuilt fused CPU kernels in {tmp_path}" in done.stderr, done
    assert "fused CPU kernels: built for this machine in" in done.stdout, done
