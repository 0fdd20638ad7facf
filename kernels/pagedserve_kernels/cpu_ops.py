"""The fused CPU kernels (`csrc/`): prebuilt per x86-64 level or built once per machine, loaded lazily.

Two ways to get the extension:
  - prebuilt for every portable x86-64 level (`python -m pagedserve_kernels.cpu_ops --prebuild DIR`, as the
    container image does at build time, where the compiler is): `load()` takes the best level this
    CPU runs from `$PAGEDSERVE_CPU_OPS_PREBUILT`, which a read-only image ships and no pod compiles;
  - otherwise compiled here with `-march=native` into the cache root (`pagedserve.paths.cache_dir()`:
    `$PAGEDSERVE_CACHE_DIR` or `~/.cache/pagedserve`). `scripts/setup.sh` builds it ahead of time;
    otherwise the first engine start does (about a minute on two cores), and later processes only
    load it.
Where neither works (no prebuilt level, no compiler, a build error) `load()` logs an error naming the
levels it looked for and where, returns None, and the engine runs the PyTorch path: slower, same
results, and shown as "torch-fallback" by the compute service's Info and metrics (`kernels.step_path`).
`PAGEDSERVE_CPU_KERNELS=0` turns the extension off.

Why a build is keyed the way it is: its code is decided by the kernels' source, the compiler flags of
its level and the torch it compiles against (headers, ABI); nothing else about the machine that built
it matters. So a build lives in `LEVEL-KEY`, KEY a hash of exactly those: the source digest covers
every file the package ships from csrc/ (`SOURCE_PATTERNS`, the globs of pyproject.toml's package-data;
a test keeps the two equal: an image once missed all its prebuilt kernels because its wheel lacked a
header, so the installed source hashed unlike the one built), and a level's flags follow from its
name. A native build also hashes this CPU's flags, since -march=native makes them part of its code.

The levels, best first: variants of a psABI level that enable more extensions, each built only
where the source tests that extension's macro (one no line tests would compile to its base's code),
then the psABI levels themselves, always built (v4: AVX-512 F/BW/CD/DQ/VL; v3: AVX2 + FMA; x86-64:
the baseline every x86-64 CPU runs).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.paths import cache_dir

_CSRC = Path(__file__).resolve().parent / "csrc"  # cpu_ops.cpp, the translation unit, and its headers
SOURCE_PATTERNS = ("*.cpp", "*.h")  # what the package ships from csrc/ (pyproject.toml's package-data)
_NAME = "pagedserve_cpu_ops"
_ENABLE_ENV = "PAGEDSERVE_CPU_KERNELS"
_PREBUILT_ENV = "PAGEDSERVE_CPU_OPS_PREBUILT"
NATIVE = "native"
# -fno-trapping-math lets float->int conversions (in exp) vectorise; neither flag changes any value.
# -fopenmp: at::parallel_for is a header template that runs `#pragma omp parallel`; without the flag
# the pragma is dropped and every op runs on one thread. The extension links the libgomp.so.1 that
# torch has already loaded (same soname), so it shares torch's thread pool.
_COMMON_CFLAGS = ["-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-std=c++17"]
_LDFLAGS = ["-fopenmp"]


@dataclass(frozen=True)
class Level:
    """A portable build target.

    Attributes:
        march: its compiler flags (they decide its code, with the source).
        needs: the /proc/cpuinfo flags a CPU must show to run it.
        macro: for a variant (a psABI level plus extensions), the preprocessor macro of the extension it
            adds to the variant below it: built only where the source tests it. None for a psABI level.
    """

    march: tuple[str, ...]
    needs: frozenset[str]
    macro: str | None = None


_V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4_FLAGS = _V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
LEVELS: dict[str, Level] = {  # best first
    # decode attention of grouped heads on AMX tiles (csrc/decode_tiles.h: Sapphire Rapids on, which all
    # have AVX512-VNNI: a float32 model's quantized linears, csrc/quant_linear.h `linear_float`)
    "x86-64-v4-avx512bf16-amx": Level(("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile",
                                       "-mamx-bf16"),
                                      _V4_FLAGS | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"},
                                      "__AMX_TILE__"),
    # a quantized linear's decode batches and prompts on int8 activations (csrc/quant_linear.h
    # `vnni_block`, `vnni_tiles`: CPUs without AMX that have AVX512-VNNI and AVX512-BF16, Zen 4 on,
    # Cooper Lake)
    "x86-64-v4-avx512bf16-vnni": Level(("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
                                       _V4_FLAGS | {"avx512_bf16", "avx512_vnni"}, "__AVX512VNNI__"),
    # bf16 conversions of the AVX-512 attention kernel in one instruction (Zen 4 on, Cooper Lake on)
    "x86-64-v4-avx512bf16": Level(("-march=x86-64-v4", "-mavx512bf16"), _V4_FLAGS | {"avx512_bf16"},
                                  "__AVX512BF16__"),
    "x86-64-v4": Level(("-march=x86-64-v4",), _V4_FLAGS),
    "x86-64-v3": Level(("-march=x86-64-v3",), _V3_FLAGS),
    "x86-64": Level(("-march=x86-64",), frozenset()),
}
_log = logging.getLogger(__name__)
_lock = threading.Lock()
# "ops": the loaded op namespace, or None once tried; "origin": where it came from, or why not;
# "level": the level loaded ("native" for a build for this machine).
_state: dict[str, Any] = {}


def amx() -> bool:
    """Whether this CPU multiplies bf16 on AMX tiles (torch's check: AMX-TILE and AMX-BF16 in cpuid and
    the kernel's leave to use them)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check is not None and check())


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def source_files(csrc: Path | None = None) -> list[Path]:
    """The kernels' source (in `csrc`, default the package's): every file the package ships from csrc/,
    in a fixed order."""
    csrc = _CSRC if csrc is None else csrc
    return sorted({path for pattern in SOURCE_PATTERNS for path in csrc.glob(pattern)})


def source_digest(csrc: Path | None = None) -> str:
    """Hex sha256 of the kernels' source (file names and contents)."""
    digest = hashlib.sha256()
    for path in source_files(csrc):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def tested_macros(csrc: Path | None = None) -> set[str]:
    """The `__NAME__` macros the source's #if / #ifdef / #elif lines test."""
    tested = set()
    for path in source_files(csrc):
        for line in path.read_text().splitlines():
            if re.match(r"\s*#\s*(if|ifdef|ifndef|elif)\b", line):
                tested.update(re.findall(r"\b__\w+__\b", line))
    return tested


def image_levels(csrc: Path | None = None) -> list[str]:
    """The levels worth shipping for this source, best first: every psABI level, and each variant whose
    macro the source tests (none off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    macros = tested_macros(csrc)
    return [name for name, level in LEVELS.items() if level.macro is None or level.macro in macros]


def supported_levels(flags: str | None = None) -> list[str]:
    """The shipped levels this CPU runs (`flags`: a /proc/cpuinfo flags line; default this CPU's), best
    first. A level whose instructions the CPU lacks is never among them."""
    have = set((flags if flags is not None else _cpu_flags()).split())
    return [name for name in image_levels() if LEVELS[name].needs <= have]


def _cflags(level: str) -> list[str]:
    """A fresh list each time: torch's extension builder appends to the one it is given."""
    if level == NATIVE:
        return ["-O3", "-march=native", *_COMMON_CFLAGS]
    return ["-O3", *LEVELS[level].march, "-mtune=generic", *_COMMON_CFLAGS]


def _key(level: str) -> str:
    """What decides a build's code: the source, torch, the flags of `level` and (native only) this CPU."""
    cpu = [_cpu_flags()] if level == NATIVE else []
    parts = [source_digest(), torch.__version__, " ".join(_cflags(level) + _LDFLAGS), *cpu]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_dir(level: str = NATIVE, root: Path | None = None) -> Path:
    """Where one build lives: `LEVEL-KEY` under `root` for a prebuilt level, under the cache root for
    `native`."""
    if root is None:
        root = cache_dir() / "cpu_ops"
    return root / f"{level}-{_key(level)}"


def origin() -> str | None:
    """Where the loaded extension came from ("prebuilt x86-64-v4 in DIR", "built for this machine in
    DIR"), or why there is none."""
    load()
    return _state.get("origin")


def level() -> str | None:
    """The level of the loaded extension ("x86-64-v4", ..., or "native"); None where none loaded."""
    load()
    return _state.get("level")


def loaded() -> Any | None:
    """The extension if `load` already loaded it, else None: never loads or builds it."""
    return _state.get("ops")


def load() -> Any | None:
    """The `torch.ops.pagedserve_cpu` namespace, loaded or built on first use; None where it is turned
    off or neither found nor built (logged once, at error level)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load_uncached()
    return _state["ops"]


def _load_prebuilt(root: Path, levels: list[str]) -> Any | None:
    """The best of `levels` (those this CPU runs, best first) found under `root`, or None."""
    for name in levels:
        library = build_dir(name, root) / f"{_NAME}.so"
        if library.is_file():
            if name != levels[0]:
                _log.warning("fused CPU kernels: no prebuilt %s in %s for this source; taking %s", levels[0], root,
                             name)
            torch.ops.load_library(str(library))
            _state["origin"], _state["level"] = f"prebuilt {name} in {library.parent}", name
            _log.info("fused CPU kernels: %s", _state["origin"])
            return torch.ops.pagedserve_cpu
    return None


def _holds(root: Path) -> str:
    """What `root` holds, for a message that says which builds were missing."""
    if not root.is_dir():
        return "no such directory"
    return "it holds: " + (", ".join(sorted(p.name for p in root.iterdir() if p.is_dir())) or "nothing")


def _looked_for(root: Path, levels: list[str]) -> str:
    """The levels looked for, where, and what is there instead: the line an operator needs."""
    return (f"levels {', '.join(levels) or 'none (not an x86-64 CPU)'} (those this CPU runs) of source "
            f"{source_digest()[:16]} and torch {torch.__version__} in {root} ({_holds(root)})")


def _compiler() -> str | None:
    """The C++ compiler torch's extension builder would call (`$CXX`, else c++), where there is one."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _build(level: str, directory: Path) -> Any:
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
        library = directory / f"{_NAME}.so"
        if library.is_file():
            # Built already, maybe by another checkout of the same source: the directory's key names
            # the source's digest, torch, the flags and the CPU, so this is the build. Loaded as it is,
            # not through torch's builder, whose build.ninja names the source's *path*: every
            # checkout at another path (a fresh clone, a worktree) rebuilt it, a minute of CPU or more.
            try:
                torch.ops.load_library(str(library))
                return torch.ops.pagedserve_cpu
            except (OSError, RuntimeError) as error:  # a library cut short by a killed link: build again
                _log.warning("fused CPU kernels: %s does not load (%s); building it again", library, error)
        # is_python_module=False: the library registers torch ops (visible to the profiler by name).
        # Copies of the flag lists: torch appends to the ones it is given, which changed build_dir()'s key.
        load_extension(name=_NAME, sources=[str(_CSRC / "cpu_ops.cpp")], extra_cflags=_cflags(level),
                       extra_ldflags=list(_LDFLAGS), build_directory=str(directory), is_python_module=False,
                       verbose=False)
    return torch.ops.pagedserve_cpu


def _load_uncached() -> Any | None:
    if os.environ.get(_ENABLE_ENV, "1") == "0":
        _log.info("fused CPU kernels turned off by %s=0", _ENABLE_ENV)
        _state["origin"] = f"turned off by {_ENABLE_ENV}=0"
        return None
    levels, prebuilt = supported_levels(), os.environ.get(_PREBUILT_ENV)
    looked = []  # what was looked for and where, for the error line
    try:
        if prebuilt:
            ops = _load_prebuilt(Path(prebuilt), levels)
            if ops is not None:
                return ops
            looked.append(f"prebuilt {_looked_for(Path(prebuilt), levels)}")
            if _compiler() is not None:  # a development machine: build instead (an image has no compiler)
                _log.warning("fused CPU kernels: no usable prebuilt build (%s); building them for this machine",
                             looked[-1])
        directory = build_dir()
        looked.append(f"a build for this machine in {directory}")
        if not (directory / f"{_NAME}.so").is_file() and _compiler() is None:
            raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) to build them")
        ops = _build(NATIVE, directory)
        _state["origin"], _state["level"] = f"built for this machine in {directory}", NATIVE
        return ops
    except Exception as error:  # any build failure means: run the PyTorch path, and say so loudly
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        _state["origin"] = f"unavailable ({type(error).__name__}: {reason})"
        _log.error("no usable fused CPU kernels: serving on the slower PyTorch path (torch-fallback). "
                   "Looked for %s; %s", "; then ".join(looked), _state["origin"])
        return None


def prebuild(root: Path, levels: list[str] | None = None) -> list[Path]:
    """Build the extension for each of `levels` (default: `image_levels()`) under `root`, keeping only
    the libraries.

    Each level builds in a child process: torch loads what it builds, and loading a level the building
    CPU lacks could fault (the child's exit status is not trusted; the library file is)."""
    if levels is None:
        levels = image_levels()
    built = []
    for level in levels:
        if level not in LEVELS:
            raise ValueError(f"--level: {level!r} is not one of {sorted(LEVELS)}")
        directory = build_dir(level, root)
        library = directory / f"{_NAME}.so"
        if library.is_file():  # built already (the key names the source, torch and the level's flags)
            built.append(library)
            continue
        # This file as a script: the image builds from kernels/pagedserve_kernels/cpu_ops.py and csrc alone.
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build-one", level, "--root", str(root)],
                       check=False, timeout=1800)
        if not library.is_file():
            raise RuntimeError(f"building the fused CPU kernels for {level} failed (no {library})")
        for leftover in directory.iterdir():  # object files, ninja state: not needed to load
            if leftover != library:
                leftover.unlink() if leftover.is_file() else shutil.rmtree(leftover)
        (root / f"{directory.name}.flock").unlink(missing_ok=True)  # the build's lock: the root holds builds only
        built.append(library)
    return built


def missing_levels(root: Path) -> list[str]:
    """The levels this source ships (`image_levels()`) that have no build under `root`: what an image
    build checks once the package is installed, so that an image whose installed source differs from the
    one its kernels were built from fails to build instead of serving on the slow path."""
    return [name for name in image_levels() if not (build_dir(name, root) / f"{_NAME}.so").is_file()]


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pagedserve_kernels.cpu_ops",
                                     description="Build the fused CPU kernels now (for this machine by default).")
    parser.add_argument("--prebuild", type=Path, metavar="DIR",
                        help="build portable levels into DIR (for $PAGEDSERVE_CPU_OPS_PREBUILT) instead")
    parser.add_argument("--level", action="append", choices=sorted(LEVELS),
                        help="a level to prebuild (repeatable; default: every level this source ships)")
    parser.add_argument("--check", type=Path, metavar="DIR",
                        help="exit 1 unless DIR holds a build of every level for the installed source")
    parser.add_argument("--build-one", choices=sorted(LEVELS), help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if args.build_one:
        _build(args.build_one, build_dir(args.build_one, args.root))
    elif args.check:
        missing = missing_levels(args.check)
        if missing:
            sys.exit(f"fused CPU kernels: no build of {', '.join(missing)} for source {source_digest()[:16]} and "
                     f"torch {torch.__version__} in {args.check} ({_holds(args.check)})")
        print(f"fused CPU kernels: {', '.join(image_levels())} in {args.check} for source {source_digest()[:16]}")
    elif args.prebuild:
        for library in prebuild(args.prebuild, args.level):
            print("fused CPU kernels: built", library)
    else:
        print("fused CPU kernels:", origin())


if __name__ == "__main__":  # `python -m pagedserve_kernels.cpu_ops`: build now (scripts/setup.sh does)
    _main()
