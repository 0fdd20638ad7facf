"""The one map between dtype names and torch dtypes, shared by every package.

Names are what configs, flags and the wire carry (``KvLayout.dtype``, ``EngineConfig.dtype``, the
pool descriptor); torch dtypes are what tensors use. The canonical names are torch's own, so that
``dtype_name(t)`` round-trips through ``DTYPES``; the short aliases are accepted only where a person
types a dtype (``parse_dtype``), never stored.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Bytes per element of each canonical name: all the memory service needs, so that it never imports
# torch on the CPU path (seconds of CPU at every start). ``DTYPES`` (name -> torch dtype) imports
# torch on first use.
ELEMENT_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# The default dtype setting: the best the device computes natively (`resolve_auto`).
AUTO = "auto"
# /proc/cpuinfo flags of native bfloat16 arithmetic, best first: AMX tiles (Intel Sapphire Rapids on),
# then AVX512-BF16 (Intel Cooper Lake on, AMD Zen 4 on). oneDNN runs bf16 matmuls on either.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# How the weights are held (``EngineConfig.quantization``): "auto" keeps a GGUF file's quantized tensors
# as they are and a float checkpoint in the dtype, "none" widens all to the dtype, "int8" / "int4"
# quantize at load (kernels/pagedserve_kernels/quant.py).
QUANTIZATIONS = ("auto", "none", "int8", "int4")


def _torch_dtypes() -> dict[str, torch.dtype]:
    table = globals().get("DTYPES")
    if table is None:
        import torch

        table = globals()["DTYPES"] = {"float32": torch.float32, "float16": torch.float16,
                                       "bfloat16": torch.bfloat16}
    return table


def __getattr__(name: str) -> object:
    """``DTYPES``: name -> torch dtype, the canonical names of ``ELEMENT_SIZES``; built (importing
    torch) the first time it is asked for."""
    if name == "DTYPES":
        return _torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical name or an alias; ValueError naming the choices otherwise."""
    dtype = _torch_dtypes().get(DTYPE_ALIASES.get(name, name))
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not one of {sorted([*ELEMENT_SIZES, *DTYPE_ALIASES])}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a supported torch dtype; ValueError for any other."""
    for name, candidate in _torch_dtypes().items():
        if candidate == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not one of {', '.join(ELEMENT_SIZES)}")


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none to read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def native_bf16_flag(flags: set[str] | None = None) -> str | None:
    """The CPU flag that makes bfloat16 native here (``NATIVE_BF16_FLAGS``), or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    have = cpu_flags() if flags is None else flags
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in have), None)


def resolve_auto(device: str | torch.device, flags: set[str] | None = None) -> tuple[str, str]:
    """The dtype ``auto`` means on ``device``, and why: (canonical name, reason).

    CUDA: bfloat16. CPU: bfloat16 where it has native bf16 arithmetic (``native_bf16_flag``: then
    bf16 weights halve the bytes every decode step reads and oneDNN multiplies them natively),
    float32 elsewhere (without it, bf16 matmuls are emulated and slower than float32).
    """
    import torch

    if torch.device(device).type == "cuda":
        return "bfloat16", "cuda"
    flag = native_bf16_flag(flags)
    if flag is not None:
        return "bfloat16", f"cpu has {flag}"
    return "float32", "cpu has no native bf16 (" + ", ".join(NATIVE_BF16_FLAGS) + ")"
