"""The KV pool: one allocation holding every layer's K and V blocks, shared with the compute side.

Layout (fixed, see docs/design.md): ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``.
CPU: POSIX shared memory that the compute process maps by name. CUDA: one device allocation whose
torch CUDA IPC handle the compute process opens (same device). Either way both processes index the
very same bytes, and the pool outlives any compute service that attached to it.
"""

from __future__ import annotations

import math
import os
import pickle
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Protocol

import torch

from pagedserve.dtypes import DTYPES


@dataclass(frozen=True)
class KvLayout:
    """What the attaching model needs per block; validated on construction."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not 1 <= value <= 65536:
                raise ValueError(f"layout.{name} must be in [1, 65536], got {value}")
        if self.dtype not in DTYPES:
            raise ValueError(f"layout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class PoolDescriptor:
    """Everything another process needs to map the pool (mirrors memory.v1.PoolDescriptor)."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    shm_name: str | None = None
    cuda_ipc_handle: bytes | None = None

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


class KvPool(Protocol):
    """A KV pool owned by the memory service (CPU shared memory or a CUDA allocation)."""

    tensor: torch.Tensor  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)

    def descriptor(self) -> PoolDescriptor: ...

    def copy_block(self, src: int, dst: int) -> None: ...

    def close(self) -> None: ...


class SharedMemoryPool:
    """POSIX shared memory (``/dev/shm/<name>``) viewed as a torch tensor; the service owns and unlinks it."""

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self._dtype = dtype
        num_bytes = math.prod(shape) * torch.empty((), dtype=DTYPES[dtype]).element_size()
        self._shm = shared_memory.SharedMemory(
            name=f"pagedserve-kv-{os.getpid()}-{secrets.token_hex(4)}", create=True, size=num_bytes
        )
        # Pages are untouched until written: creating a large pool costs no RAM up front.
        self.tensor = torch.frombuffer(self._shm.buf, dtype=DTYPES[dtype], count=math.prod(shape)).view(shape)

    def descriptor(self) -> PoolDescriptor:
        return PoolDescriptor(shape=tuple(self.tensor.shape), dtype=self._dtype, device="cpu", shm_name=self._shm.name)

    def copy_block(self, src: int, dst: int) -> None:
        self.tensor[:, :, dst].copy_(self.tensor[:, :, src])

    def close(self) -> None:
        del self.tensor  # release the exported buffer before closing the mapping
        try:
            self._shm.close()
        except BufferError:
            pass  # a view is still alive somewhere in this process; the unlink below still frees the name
        self._shm.unlink()


class CudaPool:
    """One device allocation shared through torch's CUDA IPC (same device, other process)."""

    def __init__(self, shape: tuple[int, ...], dtype: str, device: str) -> None:
        self._dtype = dtype
        self.tensor = torch.zeros(shape, dtype=DTYPES[dtype], device=device)

    def descriptor(self) -> PoolDescriptor:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(self.tensor)
        return PoolDescriptor(
            shape=tuple(self.tensor.shape),
            dtype=self._dtype,
            device=str(self.tensor.device),
            cuda_ipc_handle=pickle.dumps((rebuild, args)),
        )

    def copy_block(self, src: int, dst: int) -> None:
        self.tensor[:, :, dst].copy_(self.tensor[:, :, src])

    def close(self) -> None:
        del self.tensor


def create_pool(layout: KvLayout, num_blocks: int, device: str) -> KvPool:
    """Allocate the pool for ``num_blocks`` blocks of ``layout`` on ``device``."""
    shape = layout.shape(num_blocks)
    if device == "cpu":
        return SharedMemoryPool(shape, layout.dtype)
    return CudaPool(shape, layout.dtype, device)


def free_device_bytes(device: str) -> int:
    """Free memory of the device: GPU memory on CUDA; on CPU the smaller of available RAM and /dev/shm space."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    available = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    stat = os.statvfs("/dev/shm")
    return min(available, stat.f_bavail * stat.f_frsize)


class MappedPool:
    """The compute side's view of a pool: maps a descriptor, unmaps on close."""

    def __init__(self, descriptor: PoolDescriptor) -> None:
        dtype = DTYPES[descriptor.dtype]
        numel = math.prod(descriptor.shape)
        if descriptor.shm_name is not None:
            # torch maps the shm file MAP_SHARED; unlike multiprocessing.SharedMemory it does not
            # register the name with a resource tracker that would unlink the service's pool when
            # this process exits.
            path = f"/dev/shm/{descriptor.shm_name.lstrip('/')}"
            self.tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(descriptor.shape)
        elif descriptor.cuda_ipc_handle is not None:
            rebuild, args = pickle.loads(descriptor.cuda_ipc_handle)
            self.tensor = rebuild(*args)
        else:
            raise ValueError("pool descriptor has neither shm_name nor cuda_ipc_handle")

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]
