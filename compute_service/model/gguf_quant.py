"""A GGUF tensor's own quantization, as integers and per-group scales and mins, taken from its blocks.

Every block type we load is affine in its integers within a group of inputs: W = q * scale + min (Q8_0:
min 0; Q4_0: q - 8 scaled, so min = -8 d; Q4_K: scale d * sc, min -dmin * m; Q6_K: groups of 16...).
Rather than re-implement each type's bit packing, `file_quantization` reads a tensor's integers and
scales with the `gguf` package's own de-quantizer, three times: as stored (W), with every integer field
set to 0 (the min of each group) and with every integer set to 1 (min + scale); then q = round((W -
min) / scale). Only where each type keeps its integers is ours to know (`_LAYOUTS`, from ggml's block
structs); the result is checked against the de-quantized weight and a mismatch is an error, never a
silently different model.

The integers fit our kernels' 4-bit (Q4_*), 6-bit (Q5_*, Q6_K) or 8-bit (Q8_0) weights
(kernels/pagedserve_kernels/quant.py) with the file's groups: what `--quantization auto` serves.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch


@dataclass(frozen=True)
class _Layout:
    """Where a block type keeps its integers: (start, stop, byte for q = 1) byte ranges of a block
    (0 in every range is q = 0); `group`, inputs per scale; `bits`, the kernels' width that holds q;
    `factors`, a K-quant's byte offsets of its float16 d and dmin (None: no min), the factors its
    integer sub-scales and sub-mins multiply (each block is one superblock of SUPERBLOCK inputs)."""

    fields: tuple[tuple[int, int, int], ...]
    group: int
    bits: int
    factors: tuple[int, int | None] | None = None


SUPERBLOCK = 256  # inputs of a K-quant block: one d (and dmin) over its sub-blocks' integer scales


# From ggml-common.h's block_* structs. Nibble fields hold q = 1 as 0x11; high-bit fields (qh) as 0.
_LAYOUTS = {
    "Q8_0": _Layout(((2, 34, 0x01),), 32, 8),
    "Q4_0": _Layout(((2, 18, 0x11),), 32, 4),
    "Q4_1": _Layout(((4, 20, 0x11),), 32, 4),
    "Q5_0": _Layout(((2, 6, 0x00), (6, 22, 0x11)), 32, 6),
    "Q5_1": _Layout(((4, 8, 0x00), (8, 24, 0x11)), 32, 6),
    "Q4_K": _Layout(((16, 144, 0x11),), 32, 4, (0, 2)),
    "Q5_K": _Layout(((16, 48, 0x00), (48, 176, 0x11)), 32, 6, (0, 2)),
    "Q6_K": _Layout(((0, 128, 0x11), (128, 192, 0x00)), 16, 6, (208, None)),
}
QUANTIZED_TYPES = tuple(_LAYOUTS)


@dataclass(frozen=True)
class FileQuantization:
    """A weight's integers (out, in) int8 (0..15 at bits 4, -32..31 at bits 6), scale and min (out, in / group)
    float32 (min None where every group's is 0), and the file's type; for a K-quant, the float16 values
    its scales and mins are whole multiples of, per SUPERBLOCK inputs (out, in / SUPERBLOCK) float32: d
    and -dmin (else None), which let the kernels hold each scale as an 8-bit integer (`pack`)."""

    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    bits: int
    type_name: str
    scale_factor: torch.Tensor | None = None
    min_factor: torch.Tensor | None = None


_MAPPED_DTYPES = {"I8": torch.int8, "F32": torch.float32}  # the converted file's integers and scales


class MappedRows:
    """An embedding table served from the converted file's integers in place, memory-mapped: a lookup
    maps its rows' pages from the page cache, copies the rows out and lets the pages go, so the
    process holds none of the table (139 MiB held packed for a 152k-token vocabulary at 1,536 inputs;
    the system's page cache keeps what it reads, reclaimably, and a lookup after reclaim reads the disk).
    Rows widen to exactly what the packed table's ``quant_rows`` gives in its float16 form: each scale
    and min rounded to float16 as `pack` rounds them, q * scale exact in float32, plus min rounded once
    (a K-quant's scales and mins packed compact are the file's exactly; here within 2^-11 of them).

    For an untied table only: a tied one is the head's weight, which the head keeps packed anyway.

    Args:
        path: a safetensors file of integers, scales and mins (`gguf_file.QUANTIZED_FILE`).
        name: the weight's name there ("model.embed_tokens.weight": ``<name>.q``, ``.scale``, ``.min``).
        entry: its `gguf_file.QUANTIZATION_INDEX` entry ({"type": "Q4_K", "bits": 4}).
    """

    def __init__(self, path: Path, name: str, entry: dict[str, Any]) -> None:
        self.bits, self.type_name = int(entry["bits"]), str(entry["type"])
        self._maps: list[mmap.mmap] = []
        with open(path, "rb") as handle:
            header_bytes = struct.unpack("<Q", handle.read(8))[0]
            header = json.loads(handle.read(header_bytes))
            parts = {part: self._map(handle, header[key], 8 + header_bytes)
                     for part in ("q", "scale", "min") if (key := f"{name}.{part}") in header}
        # Mapped copy-on-write and never written: a write would be dropped by the next lookup's DONTNEED.
        self.q, self.scale, self.minimum = parts["q"], parts["scale"], parts.get("min")
        self.group = self.q.shape[1] // self.scale.shape[1]
        if (self.minimum is not None and self.minimum.shape != self.scale.shape) or \
                self.scale.shape[0] != self.q.shape[0] or self.group * self.scale.shape[1] != self.q.shape[1]:
            raise ValueError(f"{path}: {name}'s integers {tuple(self.q.shape)}, scales {tuple(self.scale.shape)} and "
                             f"mins do not fit one table")

    def _map(self, handle: BinaryIO, meta: dict[str, Any], data_start: int) -> torch.Tensor:
        """One tensor mapped on its own (copy-on-write, never written): nothing is read until used."""
        dtype = _MAPPED_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{handle.name}: a tensor of dtype {meta['dtype']}; an embedding table read in place "
                             f"holds {', '.join(_MAPPED_DTYPES)}")
        start, stop = (data_start + offset for offset in meta["data_offsets"])
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(handle.fileno(), stop - aligned, access=mmap.ACCESS_COPY, offset=aligned)
        mapped.madvise(mmap.MADV_RANDOM)  # a lookup's rows only: no read-ahead around them
        self._maps.append(mapped)
        return torch.frombuffer(mapped, dtype=dtype, count=(stop - start) // dtype.itemsize,
                                offset=start - aligned).view(meta["shape"])

    @property
    def num_rows(self) -> int:
        return self.q.shape[0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (T,) int64 as float32 (T, hidden)."""
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.num_rows):
            raise ValueError(f"embedding rows: ids must be in [0, {self.num_rows}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")

        def per_input(groups: torch.Tensor) -> torch.Tensor:  # (vocab, groups) f32 -> the ids' (T, hidden)
            return groups.index_select(0, ids).half().float().repeat_interleave(self.group, dim=1)

        out = self.q.index_select(0, ids).float().mul_(per_input(self.scale))
        # + 0 where there is no min, as the kernel adds it: a negative scale times q = 0 is +0.0 there too.
        out.add_(per_input(self.minimum) if self.minimum is not None else 0.0)
        # A read maps its neighbours too (the kernel's fault-around: 64 KiB a page fault), so pages kept
        # mapped would add up to the whole table under traffic: none stays mapped past its lookup.
        self.drop_resident()
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole table as float32 (vocab, hidden) (tests' reference)."""
        return self.rows(torch.arange(self.num_rows))

    def drop_resident(self) -> None:
        """Let go of the pages mapped so far (a lookup's, a load's fingerprint samples): they stay in
        the page cache, and a later lookup maps back only its own rows."""
        for mapped in self._maps:
            mapped.madvise(mmap.MADV_DONTNEED)


def file_quantization(tensor: Any) -> FileQuantization | None:
    """The integers and scales of a quantized 2-D GGUF tensor (`gguf.ReaderTensor`), rows in the file's
    order; None for a float tensor (F32, F16, BF16).

    Raises:
        ValueError: the integers and scales do not give back the file's de-quantized weight.
    """
    type_name = tensor.tensor_type.name
    layout = _LAYOUTS.get(type_name)
    if layout is None or len(tensor.shape) != 2:
        return None
    raw = np.array(tensor.data)  # (out, bytes per row)
    out = raw.shape[0]
    inputs = int(tensor.shape[0])  # ggml's order: (in, out)
    block_bytes = _block_bytes(raw, inputs, type_name)
    blocks = raw.reshape(out, -1, block_bytes)
    # Rows in chunks of ~4 MB of blocks, on the cores: gguf's de-quantizer and the arithmetic below are
    # numpy's, which lets go of the GIL over large arrays; and a chunk's float copies stay small (the
    # whole 152k-row table at once held ~4.7 GB of them).
    step = max(1, _CHUNK_BYTES // raw.shape[1])
    chunks = [raw[i:i + step] for i in range(0, out, step)]
    # At most _READ_THREADS (each holds ~150 MB of a chunk's float copies); the CPUs this process may use.
    workers = min(len(chunks), len(os.sched_getaffinity(0)), _READ_THREADS)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        parts = list(pool.map(lambda rows: _integers(rows, tensor.tensor_type, layout, inputs, block_bytes), chunks))
    q, scale, minimum = (np.concatenate([part[i] for part in parts]) for i in range(3))
    low, high = {4: (0, 15), 6: (0, 63), 8: (-128, 127)}[layout.bits]  # as the blocks hold them
    error, largest = max(part[3] for part in parts), max(part[4] for part in parts)
    if q.min(initial=0) < low or q.max(initial=0) > high or error > 1e-5 * max(1.0, largest):
        raise ValueError(f"GGUF tensor {tensor.name!r} ({type_name}): its blocks do not read as integers with "
                         f"per-group scales (error {error:.3g}); serve it with --quantization none")
    # Q6_K's and Q5_0's 0..63 / 0..31 centred to -32..31 / -16..15; Q5_1's and Q5_K's 0..31 (their mins
    # vary) fit the 6-bit range as they are.
    q, minimum = _centre(q, scale, minimum, layout.bits)
    kept_min = None if minimum is None or not minimum.any() else torch.from_numpy(minimum.astype(np.float32))
    scale_factor = min_factor = None
    if layout.factors is not None:
        d_at, dmin_at = layout.factors
        scale_factor = _half(blocks, d_at)
        min_factor = -_half(blocks, dmin_at) if dmin_at is not None and kept_min is not None else None
    return FileQuantization(torch.from_numpy(q.reshape(out, inputs).astype(np.int8)),
                            torch.from_numpy(scale.astype(np.float32)), kept_min, layout.bits, type_name,
                            scale_factor, min_factor)


_CHUNK_BYTES = 4 << 20  # of a tensor's blocks, read as integers at a time
_READ_THREADS = 4


def _integers(raw: np.ndarray, tensor_type: Any, layout: _Layout, inputs: int, block_bytes: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """Rows of blocks (rows, bytes) as integers q (rows, groups, group), scale and min (rows, groups),
    read with gguf's de-quantizer three times: as stored (W), every integer field set to 0 (the min)
    and to 1 (min + scale); q = round((W - min) / scale). Also the largest |q * scale + min - W| and
    the largest |W|, for the caller's check."""
    from gguf.quants import dequantize

    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, block_bytes)
    zero, one = blocks.copy(), blocks.copy()
    for start, stop, one_byte in layout.fields:
        zero[..., start:stop] = 0
        one[..., start:stop] = one_byte
    groups = inputs // layout.group
    values = dequantize(raw, tensor_type).reshape(rows, groups, layout.group)
    minimum = dequantize(zero.reshape(raw.shape), tensor_type).reshape(rows, groups, layout.group)[..., 0]
    scale = dequantize(one.reshape(raw.shape), tensor_type).reshape(rows, groups, layout.group)[..., 0] - minimum
    safe = np.where(scale == 0, 1.0, scale)
    q = np.rint((values - minimum[..., None]) / safe[..., None])
    q = np.where(scale[..., None] == 0, 0.0, q)
    error = float(np.abs(q * scale[..., None] + minimum[..., None] - values).max(initial=0.0))
    return q, scale, minimum, error, float(np.abs(values).max(initial=0.0))


def _half(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block (out, blocks, bytes), as float32 (out, blocks)."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32))


def _centre(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray | None]:
    """At 6 and 8 bits, a min that is the same whole number of scales in every group (Q6_K's -32, Q5_0's
    -16) moves into the integers (q - 32 in -32..31), leaving no min to store or add; else as they are."""
    live = scale != 0
    if bits == 4 or not live.any() or (minimum[~live] != 0).any():
        return q, minimum
    centre = float(np.rint(np.mean(minimum[live] / scale[live])))
    centred = q + centre * live[..., None]
    low, high = (-32, 31) if bits == 6 else (-128, 127)
    fits = low <= centred.min() and centred.max() <= high
    before = q * scale[..., None] + minimum[..., None]
    if not fits or np.abs(centred * scale[..., None] - before).max(initial=0.0) > 1e-6 * max(1.0, np.abs(before).max()):
        return q, minimum
    return centred, None


def _block_bytes(raw: np.ndarray, inputs: int, type_name: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if raw.shape[1] != inputs // block_size * type_size:
        raise ValueError(f"GGUF tensor of {type_name}: {raw.shape[1]} bytes a row for {inputs} inputs")
    return type_size
