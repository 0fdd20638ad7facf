"""The one map between dtype names and torch dtypes, shared by every package.

Names are what configs, flags and the wire carry (``KvLayout.dtype``, ``EngineConfig.dtype``, the
pool descriptor); torch dtypes are what tensors use. The canonical names are torch's own, so that
``dtype_name(t)`` round-trips through ``DTYPES``; the short aliases are accepted only where a person
types a dtype (``parse_dtype``), never stored.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical name or an alias; ValueError naming the choices otherwise."""
    dtype = DTYPES.get(DTYPE_ALIASES.get(name, name))
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not one of {sorted([*DTYPES, *DTYPE_ALIASES])}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a supported torch dtype; ValueError for any other."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not one of {', '.join(DTYPES)}")
