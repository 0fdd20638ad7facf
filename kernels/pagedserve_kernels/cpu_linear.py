"""Prepacked CPU matmuls: each weight reordered once into oneDNN's blocked layout.

`F.linear` on CPU calls MKL's sgemm, which repacks the weight matrix into its own panel layout on
every call. At decode batch sizes (tens of rows) that repacking costs about as much as the product
itself, on every projection of every layer of every step. A weight reordered once by oneDNN
(`torch.ops.mkldnn._reorder_linear_weight`, the op Inductor's CPU freezing pass uses) is read as it
is, faster at every batch size, most at decode's few rows (docs/benchmarks.md, "Figures behind the
code's choices").

float32 and bfloat16 CPU weights are packed; anywhere else (CUDA, float16, a torch without oneDNN,
`PAGEDSERVE_CPU_PREPACK=0`) `prepack` returns None and `linear` is `F.linear`. The products differ
from MKL's in float rounding only (another summation order), like any two BLAS libraries.

A few rows in bfloat16 (decode: a row per running sequence, up to `small_rows()`) go to our own
kernel instead (`pagedserve_cpu::small_linear`, csrc/small_linear_bf16.h, builds with AVX512-BF16):
it streams the plain (out, in) weight at close to the core's read bandwidth, where oneDNN's packed
matmul reached about half of it at one row. So a bf16 model keeps the plain copy of each weight
beside the packed one (`keeps_plain`): the layers' weights are held twice (212 MB more for the
default model), the price of decode at memory speed while prompts keep oneDNN's GEMM tiles. Only
while that second copy is small beside the machine's free memory (at most a quarter of
`MemAvailable`, `PLAIN_COPY_SHARE`): a large model keeps its packed weights alone, and says so in
the log, rather than doubling its weights into an out-of-memory kill. `PAGEDSERVE_CPU_SMALL_LINEAR=0`
turns the small-batch kernel off.

bfloat16: oneDNN multiplies bf16 x bf16 with float32 accumulation and rounds the output to bf16
once, on AMX tiles where the CPU has AMX-BF16 and with AVX512-BF16 dot products (vdpbf16ps)
otherwise; which one runs is oneDNN's choice at run time (`ONEDNN_VERBOSE=1` prints it). Packed
bf16 reads half the bytes of packed float32 and beats bf16 through `F.linear` (docs/benchmarks.md).

Where the CPU has AMX (`amx()`), the small-batch rows run on its tiles instead, with the same
contract (float32 accumulation, float32 or bf16 outputs): ATen's bf16 brgemm (csrc/brgemm_linear.h)
on each weight packed once into the tiles' layout (`small_weight`), which replaces the plain copy.
There the dot-product kernel fell behind oneDNN's tiles from a few rows on (3x at 16 rows), and
oneDNN's own output is rounded to bf16 (docs/benchmarks.md, "The AMX Xeon: what each kernel runs there").
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

from pagedserve_kernels.quant import QuantizedLinear

_ENABLE_ENV = "PAGEDSERVE_CPU_PREPACK"
# The most of the machine's available memory a second (plain) copy of the weights may take.
PLAIN_COPY_SHARE = 0.25
_SMALL_ENV = "PAGEDSERVE_CPU_SMALL_LINEAR"
PACKED_DTYPES = (torch.float32, torch.bfloat16)
_log = logging.getLogger(__name__)


def available() -> bool:
    """Whether weights can be packed here (oneDNN built into torch and not turned off)."""
    return os.environ.get(_ENABLE_ENV, "1") != "0" and torch.backends.mkldnn.is_available()


_SPLIT_ENV = "PAGEDSERVE_CPU_SPLIT_ROWS"  # "0" / "1": never / always split a prompt's rows (else measured)


def prepack(weight: torch.Tensor, calibrate: bool = True) -> torch.Tensor | None:
    """The (out, in) weight in oneDNN's layout, or None where `linear` should use it as it is.

    With `calibrate`, whether a prompt's rows of this shape go to oneDNN split between the threads is
    measured now (`pagedserve_cpu::packed_linear_calibrate`, csrc/cpu_ops.cpp), once per shape; the
    head, which sees a prompt's rows only when scoring one, is not worth the time."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2 or not available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except (RuntimeError, AttributeError) as error:  # an op missing from this torch build
        _log.warning("could not prepack a CPU weight (%s); using F.linear", error)
        return None
    ops = _ops() if calibrate else None
    if ops is not None:
        forced = os.environ.get(_SPLIT_ENV, "")
        try:
            ops.packed_linear_calibrate(packed, int(forced) if forced in ("0", "1") else -1)
        except RuntimeError as error:  # e.g. out of memory for the trial rows: oneDNN's own threading
            _log.warning("could not time the row split for a %s weight (%s); not splitting", tuple(weight.shape), error)
    return packed


def amx() -> bool:
    """Whether this CPU multiplies bf16 on AMX tiles (`cpu_ops.amx`)."""
    from pagedserve_kernels import cpu_ops  # not at import: `python -m pagedserve_kernels.cpu_ops` runs it

    return cpu_ops.amx()


def _ops() -> Any | None:
    from pagedserve_kernels import cpu_ops  # loads (or builds) the extension: not at import

    return cpu_ops.load()


def small_rows(dtype: torch.dtype) -> int:
    """The most rows `linear` gives the small-batch kernel in `dtype` (0: none here, or turned off)."""
    if dtype != torch.bfloat16 or os.environ.get(_SMALL_ENV, "1") == "0":
        return 0
    ops = _ops()
    return ops.small_linear_rows() if ops is not None else 0


def _tiles(ops: Any) -> bool:
    return amx() and ops.brgemm_linear_available()


def small_weight(weight: torch.Tensor) -> torch.Tensor:
    """The copy of a bf16 (out, in) weight the small-batch kernel reads: packed for AMX tiles where the
    CPU has them and they take its shape (out a multiple of 64, in even), else the weight itself."""
    ops = _ops() if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" else None
    if ops is None or not _tiles(ops):
        return weight
    out, inputs = weight.shape
    if out % ops.brgemm_block_n() or inputs % 2:
        return weight
    return ops.brgemm_pack(weight.detach())


def linear_path(dtype: torch.dtype) -> str:
    """Which kernels a model's projections in `dtype` run here, for Info and the metrics: the small-batch
    rows ("small<=16 amx-tiles" or "small<=16 avx512-bf16"), then oneDNN ("onednn", on AMX tiles or not)."""
    if dtype not in PACKED_DTYPES or not available():
        return "torch"
    tiles = dtype == torch.bfloat16 and amx()
    large = "onednn-amx" if tiles else "onednn"
    rows = small_rows(dtype)
    if not rows:
        return large
    ops = _ops()
    return f"small<={rows} {'amx-tiles' if _tiles(ops) else 'avx512-bf16'} {large}"


def available_memory_bytes() -> int | None:
    """The kernel's estimate of memory available to new allocations (``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def keeps_plain(dtype: torch.dtype, plain_bytes: int = 0) -> bool:
    """Whether a prepacked model in `dtype` keeps its plain weights too (for the small-batch kernel).

    Args:
        plain_bytes: the size of that second copy; above `PLAIN_COPY_SHARE` of the available
            memory (or when that is unknown and the copy is not empty) it is not kept.
    """
    if small_rows(dtype) == 0:
        return False
    available_bytes = available_memory_bytes()
    if available_bytes is not None and plain_bytes <= PLAIN_COPY_SHARE * available_bytes:
        return True
    _log.warning("not keeping a plain copy of the weights for the small-batch linear: %d MiB against "
                 "%s MiB available (at most %d%%); decode uses the packed weights", plain_bytes >> 20,
                 "unknown" if available_bytes is None else available_bytes >> 20, PLAIN_COPY_SHARE * 100)
    return False


def logits(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | QuantizedLinear | None,
           num_small_rows: int = 0, small: torch.Tensor | None = None) -> torch.Tensor:
    """The LM head: (N, hidden) x (vocab, hidden) weight -> (N, vocab) float32 logits.

    Where the small-batch kernel runs (up to `num_small_rows` rows: one request, or a few decoding
    together) a bfloat16 head's logits are float32 to the end, from `small` (`small_weight(weight)`,
    the head's copy for it) where given, else from the plain weight. Rounded to bf16, a logit near 10
    moves by up to 0.03, and the top two tokens are that close often enough to flip greedy answers
    (the README's own question did). Past those rows oneDNN's GEMM computes them, rounded to bf16:
    the dot-product kernel there took 4-5x as long on an AMX Xeon (docs/benchmarks.md). A head kept
    quantized (`quant.QuantizedLinear`) gives float32 logits at any number of rows.
    """
    if isinstance(packed, QuantizedLinear):
        return packed(x, float_out=True)
    if small is not None and x.shape[0] <= num_small_rows:
        return torch.ops.pagedserve_cpu.small_linear_float(x, small, None)
    return linear(x, weight, packed, None, num_small_rows, float_out=True).float()


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | QuantizedLinear | None,
           bias: torch.Tensor | None = None, num_small_rows: int = 0, float_out: bool = False) -> torch.Tensor:
    """x @ weight.T + bias: the small-batch kernel for up to `num_small_rows` rows, else through the
    packed weight when there is one. With `float_out` the small-batch kernel's outputs are float32
    (skipping a rounding to bf16 where the caller takes float32); the other paths keep x's dtype.

    Args:
        x: (N, in) activations.
        weight: (out, in), used when `packed` is None or N <= num_small_rows (empty where released; on
            an AMX CPU the 4-D tile layout of `small_weight`, which only the small-batch kernel reads).
        packed: `prepack(weight)`, a `quant.QuantizedLinear` (the weight kept quantized, its bias
            inside: `bias` is not added again), or None.
        bias: (out,) or None.
        num_small_rows: `small_rows(x.dtype)`, or 0 to never take the small-batch kernel.
    """
    if isinstance(packed, QuantizedLinear):
        return packed(x, float_out)
    if x.shape[0] <= num_small_rows and weight.numel():
        if float_out:
            return torch.ops.pagedserve_cpu.small_linear_float(x, weight, bias)
        return torch.ops.pagedserve_cpu.small_linear(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    ops = _ops()
    if ops is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return ops.packed_linear(x, packed, bias)  # the same, a prompt's rows split where `prepack` measured it faster
