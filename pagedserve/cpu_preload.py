"""tcmalloc and Intel OpenMP for a CPU compute process: found, then put in place by one re-exec.

vLLM's CPU build asks for both (LD_PRELOAD of tcmalloc and libiomp5), and so may we: the engine's
many small allocations per step go to tcmalloc's thread caches instead of glibc's arenas, and
torch's OpenMP regions run on Intel's runtime (it keeps its threads spinning for a moment between
regions, where GNU libgomp puts them to sleep sooner: a decode step is hundreds of small regions).
Both must be loaded before anything else: ServiceProcess starts ``compute_service`` with
``LD_PRELOAD`` set (``env_for``), and a process started otherwise re-executes itself once, before it
imports torch (``maybe_reexec``: the same pid goes on, so the parent's handle, ``--parent-pid`` and
signals are unaffected). The in-process ``LLM`` cannot: run its script under ``LD_PRELOAD``.

Intel OpenMP is the lever, above all where other processes share the cores: every OpenMP region
of a step waits for the thread that has no core, and GNU libgomp makes that wait a time slice where
Intel's runtime yields; tcmalloc adds a little on top (the measured step times: docs/benchmarks.md,
"Levers measured").

``PAGEDSERVE_CPU_PRELOAD``: ``1`` (the default: when libiomp5 is found), ``0`` (never).
``PAGEDSERVE_CPU_PIN=1`` also pins the OpenMP threads one per CPU of the process's affinity
(``KMP_AFFINITY``), vLLM's ``VLLM_CPU_OMP_THREADS_BIND``: right on a machine of one's own, harmful
where other processes share the cores (a pinned thread waits for its one core). Libraries are
looked for in this Python's prefix (pip's ``intel-openmp`` puts ``libiomp5.so`` in ``<venv>/lib``)
and the system's library directories (Debian's ``libtcmalloc-minimal4``).
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

ENABLE_ENV = "PAGEDSERVE_CPU_PRELOAD"
PIN_ENV = "PAGEDSERVE_CPU_PIN"
_DONE_ENV = "_PAGEDSERVE_CPU_PRELOADED"  # the libraries we preloaded: never loop, and strip_env
_SYSTEM_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                "/usr/local/lib")
TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
IOMP = ("libiomp5.so",)


def find_library(names: tuple[str, ...], dirs: list[str]) -> str | None:
    """The first of ``names`` in ``dirs``, as a path."""
    for directory in dirs:
        for name in names:
            path = Path(directory) / name
            if path.is_file():
                return str(path)
    return None


def preload_env(env: dict[str, str], prefix: str = sys.prefix) -> dict[str, str] | None:
    """``env`` plus the preload settings, or None when there is nothing to do (turned off, already
    done, or no Intel OpenMP: it is the lever; tcmalloc joins it where installed)."""
    if env.get(ENABLE_ENV, "1") == "0" or env.get(_DONE_ENV):
        return None
    dirs = [str(Path(prefix) / "lib"), *_SYSTEM_DIRS]
    iomp = find_library(IOMP, dirs)
    if iomp is None:
        return None
    libs = [lib for lib in (find_library(TCMALLOC, dirs), iomp) if lib is not None]
    current = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    new = dict(env)
    new["LD_PRELOAD"] = ":".join([*libs, *(p for p in current if p not in libs)])
    new[_DONE_ENV] = ":".join(libs)
    if env.get(PIN_ENV) == "1" and "KMP_AFFINITY" not in env:
        cpus = sorted(os.sched_getaffinity(0))
        new["KMP_AFFINITY"] = f"granularity=fine,explicit,proclist=[{','.join(map(str, cpus))}]"
        new.setdefault("OMP_NUM_THREADS", str(len(cpus)))
    return new


def strip_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what preload_env added: for the other services a preloaded process starts
    (a memory service or gateway gains nothing from it, and a process killed with Intel OpenMP
    loaded leaves its registration file in /dev/shm)."""
    ours = env.get(_DONE_ENV)
    if not ours:
        return env
    new = {k: v for k, v in env.items() if k != _DONE_ENV}
    kept = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p not in ours.split(":")]
    if kept:
        new["LD_PRELOAD"] = ":".join(kept)
    else:
        new.pop("LD_PRELOAD", None)
    return new


def is_preloaded() -> bool:
    """Whether this process runs with the preload (for logs and benchmark reports)."""
    return bool(os.environ.get(_DONE_ENV))


def env_for(argv: list[str], env: dict[str, str]) -> dict[str, str] | None:
    """The environment to start a CPU compute process ``argv`` with, or None to leave ``env`` as it is.
    Only for CPU work: a CUDA process gains nothing from it, so ``cuda...`` in ``argv`` skips it."""
    if any(a.startswith("cuda") for a in argv) or sys.platform != "linux":
        return None
    return preload_env(env)


def release_free_memory() -> str | None:
    """Hand the memory the allocator holds free back to the system; returns which allocator did it.

    Loading a model frees as much as it keeps (a GGUF's tensors read, widened or quantized, then
    dropped: 1.4 GB for a 1.5B model's 1.3 GB of weights), and neither tcmalloc nor glibc's malloc
    returns freed memory to the system on its own soon: the process would stay resident at its load
    peak. Call once the weights are in place."""
    try:
        process = ctypes.CDLL(None)
    except (OSError, TypeError):  # no dlopen(NULL) here
        return None
    try:
        process.MallocExtension_ReleaseFreeMemory()  # tcmalloc, preloaded
        return "tcmalloc"
    except AttributeError:
        pass
    try:
        process.malloc_trim(0)  # glibc
        return "glibc"
    except AttributeError:
        return None


def remove_registration_files(pid: int) -> None:
    """Intel OpenMP registers each process in /dev/shm (``__KMP_REGISTERED_LIB_<pid>_<n>``) and
    unregisters it at exit; a process killed by SIGKILL leaves its file: call once ``pid`` is reaped."""
    for path in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
        path.unlink(missing_ok=True)


def maybe_reexec(module: str, argv: list[str] | None = None) -> None:
    """Re-execute ``python -m module argv`` with the preload, when it applies; else return.

    Call first thing in a ``__main__``, before torch is imported (a launcher that already set the
    environment, ServiceProcess, makes this a no-op).
    """
    argv = sys.argv[1:] if argv is None else argv
    env = env_for(argv, dict(os.environ))
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
