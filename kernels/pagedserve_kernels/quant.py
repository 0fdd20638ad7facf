"""Weights kept as 8-, 6- or 4-bit integers on the CPU, and the linear that computes on them.

A `QuantizedWeight` holds an (out, in) weight as integers q with a scale (and optionally a min) per
output and group of inputs: W[n, k] = q[n, k] * scale[n, k // group] + min[n, k // group].
Two sources make one:
  - `quantize(weight, scheme)`, from a float weight at load: int8 symmetric in groups of up to 128
    inputs (`int8_group`), int4 asymmetric in groups of 32 inputs (q in 0..15);
  - `pack(q, scale, min, bits)`, from integers and scales a file already holds (a GGUF's Q8_0, Q6_K,
    Q4_K... blocks: compute_service/model/gguf_quant.py), as they are; 6 bits (q in -32..31) holds
    Q6_K's and Q5_*'s integers in 6 bits a weight instead of int8's 8, and a K-quant's scales and mins,
    whole multiples of one float16 per SUPERBLOCK inputs (its d and dmin), are held as those 8-bit
    multiples and the float16s (`compact`): 4.625 bits a Q4_K weight (the file: 4.5), 6.5625 a Q6_K one.

`linear` multiplies by it without widening the weight: the C++ kernel (csrc/quant_linear.h)
de-quantizes a slice of a column block into bf16 in L1 and multiplies every row by it, on AMX tiles
where the CPU has them, else with AVX512-BF16 dot products; without AMX but with AVX512-VNNI, from 3
rows on, on int8 activations (`vnni_rows`: a decode batch a group at a time; `vnni_tile_rows` and
more: a prompt, in tiles of rows over whole column blocks). float32 activations multiply the integers
too, each row split in two (`float_vnni`), in a build with AVX512-BF16 and AVX512-VNNI; without them
the weight is widened per call (correct, slow: `path` says which runs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK_N = 64  # output columns a packed block holds (csrc/quant_linear.h's kBlockN)
SCHEMES = ("int8", "int4")
INT4_GROUP = 32  # inputs per scale for int4 quantized at load (GGUF's Q4 blocks hold 32 too)
# Inputs per scale for int8 quantized at load, the first that divides the inputs (else one scale per
# output). One scale per output agreed with float32 on 98.1% of next tokens of the 1.5B model, groups
# of 128 on 99.0% at the same decode speed (docs/benchmarks.md, "int8 in groups").
INT8_GROUPS = (128, 64, 32)
# What `quantize` computes, for the fingerprint (bump when its rounding or groups change).
# v3: a file's Q6_K and Q5_* at 6 bits, a K-quant's scales and mins its exact multiples of d and dmin
# (they were rounded to float16), which the identity of a file's weights (the KV tier's key) changes with.
QUANTIZER_VERSION = f"v3-int8g{INT8_GROUPS[0]}-int4g{INT4_GROUP}-k6-compact"
_MIN_SCALE = 2.0**-14  # float16's smallest normal


@dataclass(frozen=True)
class QuantizedWeight:
    """An (out_features, in_features) weight in the kernel's packed layout (csrc/quant_linear.h).

    Attributes:
        q: the integers, int8 (bits 8), 6 bits a weight (bits 6) or two to a byte (bits 4), in column
            blocks of BLOCK_N (csrc/quant_linear.h has the layouts).
        scales, mins: (blocks, in / group, BLOCK_N) float16; mins None where symmetric. Compact
            (`compact`): (blocks, in / SUPERBLOCK, 2 * BLOCK_N + SUPERBLOCK / group * BLOCK_N) uint8,
            per superblock the BLOCK_N columns' float16 factors, then each group's int8 multiples.
        bias: (out,) float32 or None.
        bits, group: 8, 6 or 4; inputs per scale.
        out_features, in_features: the weight's shape (out padded to whole blocks in q).
    """

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bias: torch.Tensor | None
    bits: int
    group: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes held (integers, scales, mins, bias)."""
        return sum(t.nbytes for t in (self.q, self.scales, self.mins, self.bias) if t is not None)

    @property
    def scheme(self) -> str:
        return f"int{self.bits}"

    @property
    def compact(self) -> bool:
        """Whether the scales (and mins) are 8-bit multiples of a float16 per SUPERBLOCK inputs."""
        return self.scales.dtype == torch.uint8

    def with_bias(self, bias: torch.Tensor | None) -> QuantizedWeight:
        """This weight with `bias` (any float dtype, (out,)) added to its products."""
        if bias is None:
            return self
        return QuantizedWeight(self.q, self.scales, self.mins, bias.detach().float().contiguous(), self.bits,
                               self.group, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32: the values the kernel multiplies by."""
        return _ops().quant_dequantize(self.q, self.scales, self.mins, self.bits, self.group, self.out_features)


def _ops():
    from pagedserve_kernels import cpu_ops  # builds or loads the extension: not at import

    ops = cpu_ops.load()
    if ops is None:
        raise RuntimeError("quantized weights need the fused CPU kernels (pagedserve_kernels.cpu_ops), which did "
                           "not load here; serve with --quantization none")
    return ops


def supports(weight_shape: torch.Size | tuple[int, ...], bits: int, group: int) -> bool:
    """Whether a (out, in) weight can be packed at `bits` with `group` inputs per scale."""
    out, inputs = weight_shape
    return out > 0 and inputs > 0 and inputs % 2 == 0 and group % 2 == 0 and inputs % group == 0


_RANGES = {8: (-128, 127), 6: (-32, 31), 4: (0, 15)}  # the integers each width holds
SUPERBLOCK = 256  # inputs a compact scale factor covers (a K-quant's block; csrc/quant_linear.h kSuperK)
# The column at each position of the 4- and 6-bit kernels' registers (csrc/quant_linear.h `x_position`):
# position 16 X + l, lane l of register X, holds column 16 (l / 4) + 4 X + l % 4.
_X_ORDER = torch.tensor([16 * (lane // 4) + 4 * x + lane % 4 for x in range(4) for lane in range(16)])


def pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, bits: int,
         scale_factor: torch.Tensor | None = None, min_factor: torch.Tensor | None = None) -> QuantizedWeight:
    """The packed weight of integers q (out, in) (-128..127 at 8 bits, -32..31 at 6, 0..15 at 4) with
    per-group scale and min (out, in / group), float values rounded to float16. With `scale_factor`
    (and `min_factor` where there are mins), (out, in / SUPERBLOCK) float16 values that every scale (min)
    of their superblock is a whole multiple of, -128..127 times, at 6 or 4 bits: the scales and mins are
    held compact, as those multiples (each exactly multiple * factor); where they are not such multiples,
    float16 as without."""
    out, inputs = q.shape
    groups = scale.shape[1]
    group = inputs // groups
    if bits not in _RANGES or not supports(q.shape, bits, group) or scale.shape != (out, groups):
        raise ValueError(f"cannot pack a {tuple(q.shape)} weight at {bits} bits with scales {tuple(scale.shape)}")
    low, high = _RANGES[bits]
    if q.numel() and not (low <= int(q.min()) and int(q.max()) <= high):
        raise ValueError(f"{bits}-bit integers must be in [{low}, {high}], got [{int(q.min())}, {int(q.max())}]")
    blocks = -(-out // BLOCK_N)
    pad = blocks * BLOCK_N - out
    q = torch.nn.functional.pad(q.to(torch.int16), (0, 0, 0, pad))
    # (blocks, BLOCK_N, in / 2, 2) -> (blocks, in / 2, BLOCK_N, 2): pairs of inputs interleaved per column
    q = q.view(blocks, BLOCK_N, inputs // 2, 2).permute(0, 2, 1, 3).contiguous()
    if bits == 8:
        packed = q.to(torch.int8)
    else:
        # each 16 columns' 32 values v[0..31] of a pair row as bytes v[i] | v[i + 16] << 4 (at 6 bits, of
        # u = q + 32 the low 4 bits, then each nibble byte j's two high 2-bit parts as h[j], 4 bits, and
        # the pair row's 64 of them as 32 bytes h[m] | h[m + 32] << 4)
        v = (q + 32 if bits == 6 else q).view(blocks, inputs // 2, BLOCK_N // 16, 32).to(torch.uint8)
        packed = (v[..., :16] & 15) | ((v[..., 16:] & 15) << 4)
        if bits == 6:
            h = ((v[..., :16] >> 4) | ((v[..., 16:] >> 4) << 2)).view(blocks, inputs // 2, BLOCK_N)
            plane = h[..., :BLOCK_N // 2] | (h[..., BLOCK_N // 2:] << 4)
            packed = torch.cat([packed.view(blocks, inputs // 2, BLOCK_N), plane], dim=-1)
        packed = packed.contiguous()

    def per_block(t: torch.Tensor, dtype: torch.dtype = torch.half) -> torch.Tensor:
        """(out, n) -> (blocks, n, BLOCK_N) in `dtype`."""
        t = torch.nn.functional.pad(t.float(), (0, 0, 0, pad))
        return t.view(blocks, BLOCK_N, t.shape[1]).permute(0, 2, 1).contiguous().to(dtype)

    def compact(multiples: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """Each superblock's BLOCK_N float16 factors, then its groups' multiples, as bytes, columns in the
        kernels' register order (`_X_ORDER`)."""
        supers = inputs // SUPERBLOCK
        factors = per_block(factor)[..., _X_ORDER].contiguous().view(torch.uint8).view(blocks, supers, 2 * BLOCK_N)
        ints = per_block(multiples, torch.int8)[..., _X_ORDER].contiguous().view(torch.uint8).view(blocks, supers, -1)
        return torch.cat([factors, ints], dim=-1).contiguous()

    scale_multiples = min_multiples = None
    # (compact where it is smaller: 2 + SUPERBLOCK / group bytes a column and superblock against 2 per group)
    if (scale_factor is not None and bits in (4, 6) and inputs % SUPERBLOCK == 0 and SUPERBLOCK % group == 0
            and SUPERBLOCK // group > 2 and scale_factor.shape == (out, inputs // SUPERBLOCK)
            and (minimum is None) == (min_factor is None)):
        scale_multiples = _multiples(scale, scale_factor)
        if minimum is not None and min_factor is not None and min_factor.shape == scale_factor.shape:
            min_multiples = _multiples(minimum, min_factor)
    if scale_multiples is not None and (minimum is None or min_multiples is not None):
        scales = compact(scale_multiples, scale_factor)
        mins = None if min_multiples is None else compact(min_multiples, min_factor)
    else:
        scales, mins = per_block(scale), None if minimum is None else per_block(minimum)
    return QuantizedWeight(packed.reshape(-1), scales, mins, None, bits, group, out, inputs)


def _multiples(values: torch.Tensor, factor: torch.Tensor) -> torch.Tensor | None:
    """values (out, groups) as whole multiples in -128..127 of their superblock's factor (out, supers),
    float16 values (a K-quant's d * sc: exact up to the float32 rounding of how they were read back),
    or None where they are not."""
    out, groups = values.shape
    if factor.dim() != 2 or factor.shape[0] != out or groups % factor.shape[1] or \
            not torch.equal(factor.half().float(), factor.float()):
        return None
    f = factor.float().repeat_interleave(groups // factor.shape[1], dim=1)
    multiples = torch.round(values.float() / torch.where(f == 0, 1.0, f))
    in_range = bool(((-128 <= multiples) & (multiples <= 127)).all())
    ok = in_range and torch.allclose(multiples * f, values.float(), rtol=2.0**-16, atol=0.0)
    return multiples.to(torch.int8) if ok else None


def int8_group(inputs: int) -> int:
    """Inputs per scale of an int8 weight quantized at load with `inputs` inputs (INT8_GROUPS)."""
    return next((group for group in INT8_GROUPS if inputs % group == 0), inputs)


def quantize(weight: torch.Tensor, scheme: str) -> QuantizedWeight:
    """A float (out, in) weight at `scheme`: "int8" (symmetric, groups of `int8_group` inputs) or
    "int4" (asymmetric, groups of INT4_GROUP inputs), round to nearest."""
    w = weight.detach().float()
    if scheme == "int8":
        out, inputs = w.shape
        groups = w.view(out, -1, int8_group(inputs))
        # float16 scales, never below its smallest normal (an all-zero group keeps q = 0, not 0 / 0)
        scale = (groups.abs().amax(dim=-1) / 127).half().float().clamp_min(_MIN_SCALE)  # (out, groups)
        q = torch.round(groups / scale[..., None]).clamp_(-127, 127).view(out, inputs)
        return pack(q, scale, None, 8)
    if scheme == "int4":
        out, inputs = w.shape
        if inputs % INT4_GROUP:
            raise ValueError(f"int4 needs inputs in whole groups of {INT4_GROUP}; this weight has {inputs}")
        groups = w.view(out, inputs // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (out, groups)
        scale = ((high - low) / 15).half().float().clamp_min(_MIN_SCALE)
        minimum = low.half().float()
        q = torch.round((groups - minimum[..., None]) / scale[..., None]).clamp_(0, 15).view(out, inputs)
        return pack(q, scale, minimum, 4)
    raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {SCHEMES}")


@functools.cache
def tiles() -> bool:
    """Whether `linear` runs on AMX tiles here (bf16 activations)."""
    from pagedserve_kernels.cpu_ops import amx

    return amx() and bool(_ops().brgemm_linear_available())


def available() -> bool:
    """Whether the quantized kernels run here at speed (the fused CPU kernels, built with AVX512-BF16)."""
    from pagedserve_kernels import cpu_ops

    ops = cpu_ops.load()
    return ops is not None and ops.quant_linear_isa() == "avx512-bf16"


def float_vnni() -> bool:
    """Whether float32 activations multiply the quantized weights as they are here (csrc/quant_linear.h
    `linear_float`: a decode's single row as two bf16 rows, itself rounded and what that leaves, within
    2^-16 of each value; more rows as two int8 rows each the same way, on AVX512-VNNI, within about 2^-16
    of each 32 inputs' largest), in a build with AVX512-BF16 and AVX512-VNNI, for weights in groups of
    whole 16-input vectors; else a float32 model's quantized weights are widened at each call."""
    return available() and bool(_ops().quant_float_vnni())


def takes(dtype: torch.dtype) -> bool:
    """Whether the quantized kernels multiply `dtype` activations by the integers here (bf16: `available`;
    float32: `float_vnni`); elsewhere a quantized weight is widened at each call."""
    return float_vnni() if dtype == torch.float32 else dtype == torch.bfloat16 and available()


def path(dtype: torch.dtype = torch.bfloat16) -> str:
    """Which kernel a quantized model's linears with `dtype` activations run here, for Info and the metrics."""
    if dtype == torch.float32 and float_vnni():
        return "quant float32 split: few rows bf16x2, more avx512-vnni int8x2"
    if dtype != torch.bfloat16 or not available():
        return "quant widened"
    return "quant amx-tiles" if tiles() else "quant avx512-bf16"


def onednn_rows() -> int:
    """From how many rows `linear` (bf16 out) runs on oneDNN's matmul over widened blocks (csrc/quant_linear.h
    `linear_onednn`); 0: not now (not in this build, or int8 activations take those rows: `vnni_tile_rows`)."""
    return int(_ops().quant_onednn_rows()) if available() else 0


def vnni_rows() -> int:
    """Up to how many rows (past the few-row path's 1-2, 1-4 for a per-column int8 weight) `linear`
    multiplies int8 activations with AVX512-VNNI a group at a time (csrc/quant_linear.h `vnni_block`;
    CPUs without AMX tiles, whatever a call's `tiles` says); 0: not now (no such path here, or the loaded
    model keeps bf16 activations: `set_int8_activations`)."""
    return int(_ops().quant_vnni_rows()) if available() else 0


def vnni_tile_rows() -> int:
    """From how many rows on `linear` multiplies int8 activations with AVX512-VNNI in tiles of rows over
    whole column blocks (csrc/quant_linear.h `vnni_tiles`: a prompt's rows, instead of oneDNN; the CPUs
    `vnni_rows` names); 0: not now (as `vnni_rows`)."""
    return int(_ops().quant_vnni_tile_rows()) if available() else 0


def set_int8_activations(on: bool) -> bool:
    """Turn the VNNI paths' int8 activations on or off for this process (`vnni_rows`, `vnni_tile_rows`:
    off, those rows de-quantize the weight into bf16 or go to oneDNN); returns whether they run now
    (never where the CPU or build has no such path). A model's choice, made at load
    (compute_service/model/activation_check.py)."""
    return bool(_ops().quant_set_int8_activations(on)) if available() else False


def release_scratch() -> None:
    """Hand back the calling thread's scratch of the int8 prompt path (a prompt chunk's int8 activations,
    tens of MB, kept from call to call so that a call pays no page faults); the next prompt takes it
    again."""
    if available():
        _ops().quant_release_scratch()


def linear(x: torch.Tensor, weight: QuantizedWeight, float_out: bool = False) -> torch.Tensor:
    """x (N, in) @ weight.T + its bias: (N, out) float32 with `float_out`, else x's dtype."""
    return torch.ops.pagedserve_cpu.quant_linear(x.contiguous(), weight.q, weight.scales, weight.mins, weight.bias,
                                                 weight.bits, weight.group, weight.out_features,
                                                 tiles() and x.dtype == torch.bfloat16, float_out)


@dataclass(frozen=True)
class QuantizedLinear:
    """A projection kept quantized: its output rows in consecutive parts, each one `QuantizedWeight`
    (a fused q/k/v whose file stores v at another type than q and k has two parts).

    Attributes:
        parts: the weights of output rows [0, a), [a, b), ... in order, biases included.
        label: how it was quantized, for the logs and the fingerprint ("int4", "Q4_K+Q6_K").
    """

    parts: tuple[QuantizedWeight, ...]
    label: str

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def __call__(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """x (N, in) -> (N, out): float32 with `float_out`, else x's dtype."""
        if len(self.parts) == 1:
            return linear(x, self.parts[0], float_out)
        return torch.cat([linear(x, part, float_out) for part in self.parts], dim=1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (T,) of the (out, in) weight as float32 (T, in): an embedding table's lookup."""
        if len(self.parts) != 1:
            raise ValueError("an embedding table is one quantized part")
        part = self.parts[0]
        return _ops().quant_rows(part.q, part.scales, part.mins, part.bits, part.group, part.out_features, ids)

    def dequantize(self) -> torch.Tensor:
        """(out, in) float32: the values the kernel multiplies by."""
        return torch.cat([part.dequantize() for part in self.parts])


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, scheme: str) -> QuantizedLinear:
    """A float (out, in) weight and its bias quantized at load (`quantize`)."""
    return QuantizedLinear((quantize(weight, scheme).with_bias(bias),), scheme)


MAX_STACK_PARTS = 2  # csrc/cpu_ops.cpp kQuantParts: the parts a projection may have for the C++ layer stack


def stack_operands(projections: list[object]) -> tuple[list[torch.Tensor | None], list[int]]:
    """The layer stack's quantized projections as `decoder_layers` takes them: per projection (in the
    stack's order; anything but a `QuantizedLinear` is not quantized) 4 tensors a part (q, scales,
    mins, bias) and 1 + 3 ints a part (parts, then bits, group, outputs), padded to MAX_STACK_PARTS.
    Both empty where a projection has more parts than that (then the layers run one by one)."""
    tensors: list[torch.Tensor | None] = []
    meta: list[int] = []
    for projection in projections:
        parts = projection.parts if isinstance(projection, QuantizedLinear) else ()
        if len(parts) > MAX_STACK_PARTS:
            return [], []
        meta.append(len(parts))
        for index in range(MAX_STACK_PARTS):
            if index < len(parts):
                part = parts[index]
                tensors += [part.q, part.scales, part.mins, part.bias]
                meta += [part.bits, part.group, part.out_features]
            else:
                tensors += [None] * 4
                meta += [0, 0, 0]
    return tensors, meta
