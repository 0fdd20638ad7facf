"""vLLM's CPU build as the benchmarks' peer: where it lives, how it is started, and the side-by-side figures.

vLLM pins its own torch and transformers, so it runs from its own git-ignored venv (``.venv-vllm`` at
the repository root, or ``$VLLM_PYTHON``), which ``scripts/vllm_venv.sh`` creates on first use. It is
given its strongest honest setting on this machine's cores, as its CPU docs ask:

- ``VLLM_CPU_KVCACHE_SPACE``: the KV budget in GiB (an integer), the same as ours;
- ``VLLM_CPU_OMP_THREADS_BIND``: its OpenMP threads pinned one per CPU this process may use, and
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (its default keeps one of two cores for its front end:
  128.6 instead of 224.7 tok/s here);
- ``LD_PRELOAD`` of tcmalloc (Debian's ``libtcmalloc-minimal4``) and the venv's Intel OpenMP
  (``libiomp5.so``), when found.

Nothing here imports vLLM: the offline peer is ``throughput/vllm_offline.py`` run by the venv's
python, the serving peer its OpenAI server (``serving/vllm_server.py``). No test starts either.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from pagedserve import cpu_preload
from pagedserve_testing.vllm_venv import vllm_python  # noqa: F401  (the peers' lookup: vllm_peer.vllm_python)

TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def find_tcmalloc(search: Iterable[str] = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib",
                                           "/usr/lib/aarch64-linux-gnu")) -> Path | None:
    """tcmalloc's shared library, when installed."""
    for directory in search:
        for name in TCMALLOC_NAMES:
            path = Path(directory) / name
            if path.exists():
                return path
    return None


def find_iomp(prefix: Path) -> Path | None:
    """Intel OpenMP (``libiomp5.so``) shipped in a venv (``prefix`` = the venv's root)."""
    hits = sorted((prefix / "lib").glob("**/libiomp5.so"))
    return hits[0] if hits else None


def kv_space_gib(kv_cache_bytes: int) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` for our budget: vLLM takes whole GiB only, so anything else is refused
    rather than rounded (both sides must hold the same KV budget)."""
    if kv_cache_bytes <= 0 or kv_cache_bytes % (1 << 30):
        raise ValueError(f"kv_cache_bytes must be a whole number of GiB to compare with vLLM "
                         f"(VLLM_CPU_KVCACHE_SPACE is an integer), got {kv_cache_bytes}")
    return kv_cache_bytes >> 30


def cpu_list(cpus: Iterable[int]) -> str:
    """``0-1`` or ``0,2,5``: the CPUs in VLLM_CPU_OMP_THREADS_BIND's syntax."""
    ordered = sorted(set(cpus))
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}" if len(ordered) > 1 else str(ordered[0])
    return ",".join(map(str, ordered))


def vllm_env(python: Path, kv_cache_bytes: int, cpus: Iterable[int] | None = None,
             base: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The environment vLLM runs with, and the part of it that we set (for the report)."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    settings = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib(kv_cache_bytes)),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
    }
    preload = [p for p in (find_tcmalloc(), find_iomp(python.parent.parent)) if p is not None]
    if preload:
        settings["LD_PRELOAD"] = ":".join(map(str, preload))
    env = cpu_preload.strip_env(dict(os.environ if base is None else base))  # vLLM gets its own preload
    env.pop("PYTHONPATH", None)  # our packages must not shadow vLLM's (we ship one named `kernels`)
    env |= settings
    return env, settings


def kmp_files() -> set[Path]:
    """Intel OpenMP's registration files in /dev/shm (``__KMP_REGISTERED_LIB_<pid>_<n>``)."""
    return set(Path("/dev/shm").glob("__KMP_REGISTERED_LIB_*"))


def remove_stale_kmp_files(before: set[Path]) -> list[Path]:
    """Remove the registration files that appeared since ``before`` and whose process is gone.

    libiomp5 leaves one behind for every process that does not exit through its atexit handler, and
    vLLM kills its engine core at shutdown: without this every vLLM run would leave files in /dev/shm.
    """
    removed = []
    for path in sorted(kmp_files() - before):
        pid = path.name.removeprefix("__KMP_REGISTERED_LIB_").split("_")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def ratio(ours: float | None, theirs: float | None, digits: int = 3) -> float | None:
    """ours / theirs, rounded; None when either is missing or theirs is 0."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return round(ours / theirs, digits)
