"""The fused CPU kernels (`csrc/cpu_ops.cpp`): built once per machine, loaded lazily, optional.

`load()` compiles the extension with `torch.utils.cpp_extension` into the cache root
(`$PAGEDSERVE_CACHE_DIR` or `~/.cache/pagedserve`) under a name that hashes the source, the torch
version and this CPU's instruction-set flags (it is built with `-march=native`), so a changed
source or another machine never picks up a stale build. `scripts/setup.sh` builds it ahead of
time; otherwise the first engine step does (about a minute on two cores), and later processes only
load it. Where it cannot be built (no compiler, no ninja, a build error) `load()` logs one warning
and returns None, and the engine runs the PyTorch path instead: slower, same results.
`PAGEDSERVE_CPU_KERNELS=0` turns the extension off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch

_SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_ops.cpp"
_ENABLE_ENV = "PAGEDSERVE_CPU_KERNELS"
# -fno-trapping-math lets float->int conversions (in exp) vectorise; neither flag changes any value.
# -fopenmp: at::parallel_for is a header template that runs `#pragma omp parallel`; without the flag
# the pragma is dropped and every op runs on one thread. The extension links the libgomp.so.1 that
# torch has already loaded (same soname), so it shares torch's thread pool.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-std=c++17"]
_LDFLAGS = ["-fopenmp"]
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ops": the loaded op namespace or None once tried


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where this machine's build lives (created on demand)."""
    root = Path(os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve")
    key = hashlib.sha256(
        b"\0".join([_SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode(), " ".join(_CFLAGS + _LDFLAGS).encode()])
    ).hexdigest()[:16]
    return root / "cpu_ops" / f"{platform.machine()}-{key}"


def load() -> Any | None:
    """The `torch.ops.pagedserve_cpu` namespace, building the extension on first use; None where
    it is turned off or cannot be built (warned once)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load_uncached()
    return _state["ops"]


def _load_uncached() -> Any | None:
    if os.environ.get(_ENABLE_ENV, "1") == "0":
        _log.info("fused CPU kernels turned off by %s=0", _ENABLE_ENV)
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        if shutil.which("ninja") is None:  # pip's ninja sits beside this interpreter, maybe off PATH
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        # is_python_module=False: the library registers torch ops (visible to the profiler by name).
        load_extension(name="pagedserve_cpu_ops", sources=[str(_SOURCE)], extra_cflags=_CFLAGS,
                       extra_ldflags=_LDFLAGS, build_directory=str(directory), is_python_module=False, verbose=False)
        return torch.ops.pagedserve_cpu
    except Exception as error:  # noqa: BLE001 - any build failure means: run the PyTorch path
        _log.warning("fused CPU kernels unavailable (%s: %s); using the slower PyTorch path",
                     type(error).__name__, str(error).strip().splitlines()[-1] if str(error).strip() else "")
        return None


if __name__ == "__main__":  # `python -m kernels.cpu_ops`: build now (scripts/setup.sh does)
    logging.basicConfig(level=logging.INFO)
    print("fused CPU kernels:", "ready in " + str(build_dir()) if load() is not None else "unavailable")
