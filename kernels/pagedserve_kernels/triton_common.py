"""Helpers shared by the Triton launchers."""

import functools
import os

import torch


def is_interpreter() -> bool:
    """True when Triton runs kernels with its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_triton_device(tensor: torch.Tensor) -> None:
    """Raise ValueError unless Triton can run on the tensor's device."""
    if not tensor.is_cuda and not is_interpreter():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got device {tensor.device}")


@functools.cache
def num_compute_units(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 16 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 16
    return torch.cuda.get_device_properties(device).multi_processor_count
