"""Prebuilt fused CPU kernels (what the container image ships): keyed on what decides their code (the
source and the level), one per level the source distinguishes, the best level this CPU runs loaded from
$PAGEDSERVE_CPU_OPS_PREBUILT, and a process without usable kernels saying so at error level."""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import pagedserve_kernels as kernels
from pagedserve_kernels import cpu_ops

ROOT = Path(__file__).resolve().parents[2]
V3 = "fpu sse2 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
V4 = f"{V3} avx512f avx512bw avx512cd avx512dq avx512vl"


@pytest.fixture
def x86_64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ops.platform, "machine", lambda: "x86_64")


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """load() tries again (and the loaded library of this process is left alone)."""
    monkeypatch.setattr(cpu_ops, "_state", {})


def test_levels_follow_the_cpu_flags(x86_64, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_ops.supported_levels(f"flags : {V4} avx512_bf16 avx512_vnni amx_tile amx_bf16") == [
        "x86-64-v4-avx512bf16-amx", "x86-64-v4-avx512bf16-vnni", "x86-64-v4-avx512bf16", "x86-64-v4", "x86-64-v3",
        "x86-64"]
    assert cpu_ops.supported_levels(f"flags : {V4} avx512_bf16 avx512_vnni") == [  # Zen 4: int8 decode batches
        "x86-64-v4-avx512bf16-vnni", "x86-64-v4-avx512bf16", "x86-64-v4", "x86-64-v3", "x86-64"]
    assert cpu_ops.supported_levels(f"flags : {V4} avx512_vnni") == [  # Ice Lake: no bf16, so not the VNNI variant
        "x86-64-v4", "x86-64-v3", "x86-64"]
    assert cpu_ops.supported_levels(f"flags : {V4} avx512_bf16 amx_tile") == [  # no AMX-BF16: not the tiles
        "x86-64-v4-avx512bf16", "x86-64-v4", "x86-64-v3", "x86-64"]
    assert cpu_ops.supported_levels(f"flags : {V4} avx512_bf16") == [
        "x86-64-v4-avx512bf16", "x86-64-v4", "x86-64-v3", "x86-64"]
    assert cpu_ops.supported_levels(f"flags : {V4}") == ["x86-64-v4", "x86-64-v3", "x86-64"]
    assert cpu_ops.supported_levels(f"flags : {V3} avx512f avx512_bf16") == ["x86-64-v3", "x86-64"]  # not v4
    assert cpu_ops.supported_levels(f"flags : {V3}".replace(" avx2", "")) == ["x86-64"]  # the baseline
    monkeypatch.setattr(cpu_ops.platform, "machine", lambda: "aarch64")
    assert cpu_ops.supported_levels(f"flags : {V4}") == []


def test_a_prebuilt_key_is_the_source_and_the_level_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    keys = {level: cpu_ops.build_dir(level, Path("/p")) for level in cpu_ops.LEVELS}
    native = cpu_ops.build_dir()
    # Another build machine: other CPU flags and model. Same prebuilt keys; the native key follows the CPU.
    monkeypatch.setattr(cpu_ops, "_cpu_flags", lambda: "flags : another cpu altogether")
    monkeypatch.setattr(cpu_ops.platform, "processor", lambda: "Another CPU model")
    assert {level: cpu_ops.build_dir(level, Path("/p")) for level in cpu_ops.LEVELS} == keys
    assert cpu_ops.build_dir() != native
    assert keys["x86-64-v3"].name.startswith("x86-64-v3-") and len(set(keys.values())) == len(keys)
    assert "-march=x86-64-v3" in cpu_ops._cflags("x86-64-v3") and "-march=native" in cpu_ops._cflags("native")
    assert "-mavx512bf16" in cpu_ops._cflags("x86-64-v4-avx512bf16")
    assert {"-mavx512bf16", "-mavx512vnni"} <= set(cpu_ops._cflags("x86-64-v4-avx512bf16-vnni"))
    assert {"-mavx512bf16", "-mamx-tile", "-mamx-bf16"} <= set(cpu_ops._cflags("x86-64-v4-avx512bf16-amx"))
    # Any shipped source file (a header too) is part of the key.
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "kernels" / "pagedserve_kernels" / "csrc", csrc)
    monkeypatch.setattr(cpu_ops, "_CSRC", csrc)
    assert cpu_ops.build_dir("x86-64-v3", Path("/p")) == keys["x86-64-v3"]  # a copy: the same source
    header = csrc / "paged_attention_avx512.h"
    header.write_text(header.read_text() + "\n// changed\n")
    assert cpu_ops.build_dir("x86-64-v3", Path("/p")) != keys["x86-64-v3"]


def test_a_variant_ships_only_where_the_source_tests_its_macro(x86_64, tmp_path: Path) -> None:
    source = ROOT / "kernels" / "pagedserve_kernels" / "csrc"
    assert {"__AVX512BF16__", "__AMX_TILE__", "__AVX512VNNI__"} <= cpu_ops.tested_macros(source)
    assert cpu_ops.image_levels(source) == ["x86-64-v4-avx512bf16-amx", "x86-64-v4-avx512bf16-vnni",
                                            "x86-64-v4-avx512bf16", "x86-64-v4", "x86-64-v3", "x86-64"]
    without = tmp_path / "csrc"
    without.mkdir()
    for path in cpu_ops.source_files(source):
        text = path.read_text().replace("__AVX512BF16__", "__PAGEDSERVE_NO_BF16__")
        text = text.replace("__AVX512VNNI__", "__PAGEDSERVE_NO_VNNI__")
        (without / path.name).write_text(text.replace("__AMX_TILE__", "__PAGEDSERVE_NO_AMX__"))
    assert cpu_ops.image_levels(without) == ["x86-64-v4", "x86-64-v3", "x86-64"]


def test_the_package_ships_every_source_file_the_key_covers() -> None:
    """The image's wheel once lacked the header: its source hashed unlike the one its kernels were
    built from, and no prebuilt level was found."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = package_data["pagedserve_kernels"]
    assert sorted(shipped) == sorted(f"csrc/{pattern}" for pattern in cpu_ops.SOURCE_PATTERNS)
    tracked = subprocess.run(["git", "ls-files", "kernels/pagedserve_kernels/csrc"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    for name in tracked:
        relative = name.removeprefix("kernels/pagedserve_kernels/")
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in shipped), f"{name} is not in the wheel"


def test_no_usable_kernels_is_an_error_and_shows_as_torch_fallback(
        x86_64, fresh_state, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """As in an image without a build for this CPU: only a v4 library where the CPU runs v3 at most (it
    is not loadable, and must not be tried), and no compiler."""
    prebuilt = tmp_path / "prebuilt"
    v4 = cpu_ops.build_dir("x86-64-v4", prebuilt)
    v4.mkdir(parents=True)
    (v4 / "pagedserve_cpu_ops.so").write_bytes(b"not a library: loading it would fail")
    monkeypatch.setattr(cpu_ops, "_cpu_flags", lambda: f"flags : {V3}")
    monkeypatch.setenv("PAGEDSERVE_CPU_OPS_PREBUILT", str(prebuilt))
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))  # no build for this machine either
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    monkeypatch.delenv("PAGEDSERVE_CPU_KERNELS", raising=False)
    with caplog.at_level(logging.INFO, logger=cpu_ops.__name__):
        assert cpu_ops.load() is None
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = error.getMessage()
    assert "serving on the slower PyTorch path (torch-fallback)" in message
    assert f"levels x86-64-v3, x86-64 (those this CPU runs) of source {cpu_ops.source_digest()[:16]}" in message
    assert f"in {prebuilt} (it holds: {v4.name})" in message
    assert f"a build for this machine in {tmp_path / 'cache'}" in message
    assert "no C++ compiler" in message
    assert cpu_ops.level() is None
    assert kernels.step_path(torch.device("cpu"), torch.float32, 64) == "torch-fallback"
    assert kernels.step_path(torch.device("cpu"), torch.float16, 64) == "torch"  # a dtype they never take


def test_turned_off_shows_as_torch_fallback(fresh_state, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")
    assert kernels.step_path(torch.device("cpu"), torch.bfloat16, 64) == "torch-fallback"
    assert cpu_ops.origin() == "turned off by PAGEDSERVE_CPU_KERNELS=0"


def test_an_image_build_checks_that_every_level_is_there(x86_64, tmp_path: Path) -> None:
    levels = cpu_ops.image_levels()
    assert cpu_ops.missing_levels(tmp_path / "none") == levels
    for level in levels[1:]:
        cpu_ops.build_dir(level, tmp_path).mkdir()
        (cpu_ops.build_dir(level, tmp_path) / "pagedserve_cpu_ops.so").touch()
    (tmp_path / f"{levels[0]}-0123456789abcdef").mkdir()  # built from another source
    assert cpu_ops.missing_levels(tmp_path) == levels[:1]


def test_prebuild_refuses_an_unknown_level(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--level"):
        cpu_ops.prebuild(tmp_path, ["native"])


def _report(env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m pagedserve_kernels.cpu_ops` in a fresh process (a library loads once per process)."""
    return subprocess.run([sys.executable, "-m", "pagedserve_kernels.cpu_ops"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "kernels"), **env})


@pytest.mark.skipif(cpu_ops.load() is None or not cpu_ops.supported_levels(),
                    reason="needs this machine's build of the fused CPU kernels on x86-64")
def test_the_best_prebuilt_level_is_loaded(tmp_path: Path) -> None:
    """This machine's own build stands in for a prebuilt library: only where it is found differs."""
    library = cpu_ops.build_dir() / "pagedserve_cpu_ops.so"
    assert kernels.step_path(torch.device("cpu"), torch.float32, 64) == "fused-cpp native"
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
    """With a compiler (a development machine) the kernels are built here instead, after a warning."""
    done = _report({"PAGEDSERVE_CPU_OPS_PREBUILT": str(tmp_path)})
    assert "no usable prebuilt build (prebuilt levels" in done.stderr, done
    assert f"in {tmp_path} (it holds: nothing)); building them for this machine" in done.stderr, done
    assert "fused CPU kernels: built for this machine in" in done.stdout, done
