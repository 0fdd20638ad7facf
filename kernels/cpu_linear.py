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

bfloat16: oneDNN multiplies bf16 x bf16 with float32 accumulation and rounds the output to bf16
once, on AMX tiles where the CPU has AMX-BF16 and with AVX512-BF16 dot products (vdpbf16ps)
otherwise; which one runs is oneDNN's choice at run time (`ONEDNN_VERBOSE=1` prints it). Packed
bf16 reads half the bytes of packed float32 and beats bf16 through `F.linear` (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

_ENABLE_ENV = "PAGEDSERVE_CPU_PREPACK"
PACKED_DTYPES = (torch.float32, torch.bfloat16)
_log = logging.getLogger(__name__)


def available() -> bool:
    """Whether weights can be packed here (oneDNN built into torch and not turned off)."""
    return os.environ.get(_ENABLE_ENV, "1") != "0" and torch.backends.mkldnn.is_available()


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """The (out, in) weight in oneDNN's layout, or None where `linear` should use it as it is."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or weight.dim() != 2 or not available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except (RuntimeError, AttributeError) as error:  # an op missing from this torch build
        _log.warning("could not prepack a CPU weight (%s); using F.linear", error)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, through the packed weight when there is one.

    Args:
        x: (N, in) activations.
        weight: (out, in), used when `packed` is None.
        packed: `prepack(weight)`, or None.
        bias: (out,) or None.
    """
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
