"""The fused CPU kernels (`csrc/cpu_ops.cpp`): prebuilt or built once per machine, loaded lazily, optional.

Two ways to get the extension:
  - prebuilt for portable x86-64 levels (`python -m kernels.cpu_ops --prebuild DIR`, as the container
    image does at build time, where the compiler is): `load()` takes the best level this CPU runs
    from `$PAGEDSERVE_CPU_OPS_PREBUILT`, which a read-only image can ship and no pod has to compile;
  - otherwise compiled here with `-march=native` into the cache root (`pagedserve.paths.cache_dir()`:
    `$PAGEDSERVE_CACHE_DIR` or `~/.cache/pagedserve`) under a name that hashes the source, the torch
    version, the flags and this CPU's instruction-set flags, so a changed source or another machine
    never picks up a stale build.
    `scripts/setup.sh` builds it ahead of time; otherwise the first engine start does (about a minute
    on two cores), and later processes only load it.
Where neither works (no compiler, no ninja, a build error) `load()` logs one warning and returns None,
and the engine runs the PyTorch path instead: slower, same results. `PAGEDSERVE_CPU_KERNELS=0` turns
the extension off.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from pagedserve.paths import cache_dir

_SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_ops.cpp"
_NAME = "pagedserve_cpu_ops"
_ENABLE_ENV = "PAGEDSERVE_CPU_KERNELS"
_PREBUILT_ENV = "PAGEDSERVE_CPU_OPS_PREBUILT"
# -fno-trapping-math lets float->int conversions (in exp) vectorise; neither flag changes any value.
# -fopenmp: at::parallel_for is a header template that runs `#pragma omp parallel`; without the flag
# the pragma is dropped and every op runs on one thread. The extension links the libgomp.so.1 that
# torch has already loaded (same soname), so it shares torch's thread pool.
_COMMON_CFLAGS = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-std=c++17"]
_CFLAGS = ["-O3", "-march=native", *_COMMON_CFLAGS[1:]]
_LDFLAGS = ["-fopenmp"]
# Portable x86-64 micro-architecture levels, best first, with the /proc/cpuinfo flags each needs
# (psABI levels: v3 is AVX2 + FMA, Haswell / Zen 1 on; v4 adds AVX-512 F/BW/CD/DQ/VL).
_V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
LEVELS: dict[str, frozenset[str]] = {
    "x86-64-v4": _V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "x86-64-v3": _V3_FLAGS,
}
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ops": the loaded op namespace or None once tried; "origin": where from


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cflags(march: str) -> list[str]:
    """A fresh list each time: torch's extension builder appends to the one it is given."""
    if march == "native":
        return list(_CFLAGS)
    return [_COMMON_CFLAGS[0], f"-march={march}", "-mtune=generic", *_COMMON_CFLAGS[1:]]


def _key(march: str) -> str:
    """What a build depends on: the source, torch, (native only) this CPU, and the flags."""
    cpu = [_cpu_flags().encode()] if march == "native" else []
    headers = [path.read_bytes() for path in sorted(_SOURCE.parent.glob("*.h"))]  # included by the source
    parts = [_SOURCE.read_bytes(), *headers, torch.__version__.encode(), *cpu,
             " ".join(_cflags(march) + _LDFLAGS).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build_dir(march: str = "native", root: Path | None = None) -> Path:
    """Where one build lives: under the cache root for `native`, under `root` for a prebuilt level."""
    if root is None:
        root = cache_dir() / "cpu_ops"
    suffix = "" if march == "native" else f"{march}-"
    return root / f"{platform.machine()}-{suffix}{_key(march)}"


def supported_levels(flags: str | None = None) -> list[str]:
    """The portable levels this CPU runs, best first (none off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    have = set((flags if flags is not None else _cpu_flags()).split())
    return [level for level, needs in LEVELS.items() if needs <= have]


def origin() -> str | None:
    """Where the loaded extension came from ("prebuilt x86-64-v4 in DIR", "built for this machine in DIR")."""
    load()
    return _state.get("origin")


def load() -> Any | None:
    """The `torch.ops.pagedserve_cpu` namespace, building the extension on first use; None where
    it is turned off or cannot be built (warned once)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load_uncached()
    return _state["ops"]


def _load_prebuilt() -> Any | None:
    root = os.environ.get(_PREBUILT_ENV)
    if not root:
        return None
    levels = supported_levels()
    for level in levels:
        library = build_dir(level, Path(root)) / f"{_NAME}.so"
        if library.is_file():
            torch.ops.load_library(str(library))
            _state["origin"] = f"prebuilt {level} in {library.parent}"
            _log.info("fused CPU kernels: %s", _state["origin"])
            return torch.ops.pagedserve_cpu
    # Not silent: a read-only image without a usable build would otherwise quietly run the slow path.
    _log.warning("no prebuilt fused CPU kernels in %s for this source, torch %s and CPU (levels it runs: %s); "
                 "building them for this machine", root, torch.__version__, ", ".join(levels) or "none")
    return None


def _build(march: str, directory: Path) -> Any:
    from torch.utils.cpp_extension import load as load_extension

    if shutil.which("ninja") is None:  # pip's ninja sits beside this interpreter, maybe off PATH
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    directory.mkdir(parents=True, exist_ok=True)
    # Why our own lock: torch's build lock is a plain file (`lock`) that a build killed midway leaves
    # behind, and every later start then waits on it forever. An flock dies with its holder, so
    # whoever holds ours knows no build is running and may clear a leftover `lock`.
    with open(directory.parent / f"{directory.name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            _log.warning("fused CPU kernels: removing a stale build lock left by a killed build (%s)", stale)
            stale.unlink(missing_ok=True)
        # is_python_module=False: the library registers torch ops (visible to the profiler by name).
        # Copies of the flag lists: torch appends to the ones it is given, which changed build_dir()'s key.
        load_extension(name=_NAME, sources=[str(_SOURCE)], extra_cflags=_cflags(march),
                       extra_ldflags=list(_LDFLAGS), build_directory=str(directory), is_python_module=False,
                       verbose=False)
    return torch.ops.pagedserve_cpu


def _load_uncached() -> Any | None:
    if os.environ.get(_ENABLE_ENV, "1") == "0":
        _log.info("fused CPU kernels turned off by %s=0", _ENABLE_ENV)
        return None
    try:
        ops = _load_prebuilt()
        if ops is not None:
            return ops
        directory = build_dir()
        ops = _build("native", directory)
        _state["origin"] = f"built for this machine in {directory}"
        return ops
    except Exception as error:  # any build failure means: run the PyTorch path
        _log.warning("fused CPU kernels unavailable (%s: %s); using the slower PyTorch path",
                     type(error).__name__, str(error).strip().splitlines()[-1] if str(error).strip() else "")
        return None


def prebuild(root: Path, levels: list[str]) -> list[Path]:
    """Build the extension for each portable level under `root`, keeping only the libraries.

    Each level builds in a child process: loading a level the building CPU lacks could fault."""
    built = []
    for level in levels:
        if level not in LEVELS:
            raise ValueError(f"--level: {level!r} is not one of {sorted(LEVELS)}")
        directory = build_dir(level, root)
        library = directory / f"{_NAME}.so"
        if library.is_file():  # built already (the key names the source, torch and flags)
            built.append(library)
            continue
        # This file as a script: the image builds from kernels/cpu_ops.py and csrc alone.
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build-one", level, "--root", str(root)],
                       check=False, timeout=1800)
        if not library.is_file():
            raise RuntimeError(f"building the fused CPU kernels for {level} failed (no {library})")
        for leftover in directory.iterdir():  # object files, ninja state: not needed to load
            if leftover != library:
                leftover.unlink() if leftover.is_file() else shutil.rmtree(leftover)
        built.append(library)
    return built


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kernels.cpu_ops",
                                     description="Build the fused CPU kernels now (for this machine by default).")
    parser.add_argument("--prebuild", type=Path, metavar="DIR",
                        help="build portable levels into DIR (for $PAGEDSERVE_CPU_OPS_PREBUILT) instead")
    parser.add_argument("--level", action="append", choices=sorted(LEVELS),
                        help="a level to prebuild (repeatable; default: all)")
    parser.add_argument("--build-one", choices=sorted(LEVELS), help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if args.build_one:
        _build(args.build_one, build_dir(args.build_one, args.root))
    elif args.prebuild:
        for library in prebuild(args.prebuild, args.level or list(LEVELS)):
            print("fused CPU kernels: built", library)
    else:
        print("fused CPU kernels:", origin() or "unavailable")


if __name__ == "__main__":  # `python -m kernels.cpu_ops`: build now (scripts/setup.sh does)
    _main()
