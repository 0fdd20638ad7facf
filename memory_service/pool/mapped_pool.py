"""The compute side's view of the KV pool: maps a descriptor from the memory service, trusting nothing.

A descriptor comes over a socket, so a compromised or impostor service could send anything. Before
mapping, the client checks that the descriptor describes exactly the pool its own layout needs
(shape, dtype, byte count), that a shared-memory name is one of ours (``SHM_NAME_PATTERN``: no
slashes, so nothing outside /dev/shm), and that the segment is a regular file of exactly that size
(mapped, never grown: ``torch.from_file`` would extend a short file). A CUDA handle arrives as plain
fields (no pickle) and must cover the pool's bytes.
"""

from __future__ import annotations

import math
import os
import stat

import torch

from pagedserve.dtypes import DTYPES

from memory_service.pool.kv_pool import SHM_DIR, SHM_NAME_PATTERN, KvLayout, PoolDescriptor, map_populated


def check_descriptor(descriptor: PoolDescriptor, layout: KvLayout, num_blocks: int) -> None:
    """Raises ``ValueError`` unless the descriptor is the pool of ``num_blocks`` blocks of ``layout``."""
    expected_shape = layout.shape(num_blocks)
    if tuple(descriptor.shape) != expected_shape:
        raise ValueError(f"pool descriptor shape {tuple(descriptor.shape)} is not {expected_shape} for this layout")
    if descriptor.dtype != layout.dtype:
        raise ValueError(f"pool descriptor dtype {descriptor.dtype!r} is not the layout's {layout.dtype!r}")
    if (descriptor.shm_name is None) == (descriptor.cuda_ipc is None):
        raise ValueError("pool descriptor must name exactly one of a shared-memory segment or a CUDA IPC handle")
    if descriptor.shm_name is not None:
        if descriptor.device != "cpu":
            raise ValueError(f"a shared-memory pool must be on cpu, got {descriptor.device!r}")
        if not SHM_NAME_PATTERN.fullmatch(descriptor.shm_name):
            raise ValueError(f"pool descriptor shm_name {descriptor.shm_name!r} is not a pagedserve segment name")
    else:
        ipc = descriptor.cuda_ipc
        if descriptor.device != f"cuda:{ipc.device_index}":
            raise ValueError(
                f"pool device {descriptor.device!r} does not match the IPC handle's cuda:{ipc.device_index}")
        if ipc.storage_offset_bytes < 0 or ipc.storage_size_bytes < descriptor.num_bytes:
            raise ValueError(
                f"the CUDA IPC storage ({ipc.storage_size_bytes} bytes) is smaller than the pool "
                f"({descriptor.num_bytes})"
            )
        if not ipc.storage_handle or not ipc.ref_counter_handle:
            raise ValueError("the CUDA IPC handle is empty")


class MappedPool:
    """The pool of a checked descriptor, mapped into this process; ``close`` drops the mapping.

    Args:
        descriptor: from the Attach reply.
        layout: the layout this client asked for.
        num_blocks: the block count from the Attach reply.

    Raises:
        ValueError: the descriptor is not the expected pool (see the module docstring).
    """

    def __init__(self, descriptor: PoolDescriptor, layout: KvLayout, num_blocks: int) -> None:
        check_descriptor(descriptor, layout, num_blocks)
        dtype = DTYPES[descriptor.dtype]
        numel = math.prod(descriptor.shape)
        if descriptor.shm_name is not None:
            self.tensor = _map_segment(descriptor.shm_name, descriptor.num_bytes, dtype, numel).view(descriptor.shape)
        else:
            self.tensor = _open_cuda_ipc(descriptor, dtype)

    def close(self) -> None:
        # The mapping goes when the last view of it does (the model runner may still hold some).
        self.tensor = None  # type: ignore[assignment]


def _map_segment(name: str, num_bytes: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != num_bytes:
            raise ValueError(f"shared-memory segment {name!r} holds {info.st_size} bytes, the pool {num_bytes}")
        # No resource tracker (unlike multiprocessing.SharedMemory): it would unlink the service's
        # segment when this process exits.
        buffer = map_populated(fd, num_bytes)
    finally:
        os.close(fd)  # the mapping stays valid without the descriptor
    return torch.frombuffer(buffer, dtype=dtype, count=numel)  # keeps `buffer` alive as long as any view


def _open_cuda_ipc(descriptor: PoolDescriptor, dtype: torch.dtype) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ipc = descriptor.cuda_ipc
    shape = torch.Size(descriptor.shape)
    contiguous_stride = torch.empty(0).new_empty(shape, device="meta").stride()
    return rebuild_cuda_tensor(
        torch.Tensor,
        shape,
        contiguous_stride,
        0,  # tensor offset in its storage: the pool is a whole allocation
        torch.storage.TypedStorage,
        dtype,
        ipc.device_index,
        ipc.storage_handle,
        ipc.storage_size_bytes,
        ipc.storage_offset_bytes,
        False,  # requires_grad
        ipc.ref_counter_handle,
        ipc.ref_counter_offset,
        ipc.event_handle if ipc.event_sync_required else None,
        ipc.event_sync_required,
    )
