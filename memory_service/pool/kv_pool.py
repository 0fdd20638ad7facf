"""The KV pool: one allocation holding every layer's K and V blocks, shared with the compute side.

Layout (fixed, see docs/design.md): ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``.
CPU: POSIX shared memory (``/dev/shm/pagedserve-kv-<pid>-<random>``) that the compute process maps
by name. CUDA: one device allocation whose CUDA IPC handle the compute process opens (same device).
Either way both processes index the very same bytes, and the pool outlives any compute service
that attached to it. The CPU pool is plain bytes to the service (it only copies whole blocks), so
the service imports torch only for a CUDA pool: importing it costs seconds of CPU at every start.

This module is the service's side; ``mapped_pool`` is the client's, which trusts nothing it is sent.

Stale segments. The service unlinks its segment when it stops. Killed (SIGKILL, or its whole
process group), it cannot, so it holds a shared ``flock`` on the segment for its life: the kernel
drops the lock when the process dies, however it dies. At start, ``remove_stale_segments`` unlinks
this user's segments that nobody holds locked (and whose creator pid is not running).
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from memory_service.config import DEFAULT_CPU_KV_CAP_BYTES
from pagedserve.dtypes import ELEMENT_SIZES

if TYPE_CHECKING:
    import torch
from pagedserve.errors import PreconditionError

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "pagedserve-kv-"
# <prefix><creator pid>-<16 hex digits>: nothing else is ever mapped (no slashes, no dots).
SHM_NAME_PATTERN = re.compile(re.escape(SHM_PREFIX) + r"[0-9]{1,10}-[0-9a-f]{16}")
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python 3.11 lacks the name


def map_populated(fd: int, num_bytes: int) -> mmap.mmap:
    """A shared read-write mapping of the segment with its page tables filled in now.

    Untouched, every 4 KiB page of the pool costs a page fault the first time a step writes K/V
    there (and, for the owner, a zeroed tmpfs page), a visible share of a long prompt's step, paid
    again for every new block until the whole pool has been used once. On a kernel without
    MADV_POPULATE_WRITE the pages fault in as they are first touched.
    """
    buffer = mmap.mmap(fd, num_bytes)
    try:
        buffer.madvise(MADV_POPULATE_WRITE)
    except OSError:
        pass
    return buffer


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
        if self.dtype not in ELEMENT_SIZES:
            raise ValueError(f"layout.dtype must be one of {sorted(ELEMENT_SIZES)}, got {self.dtype!r}")

    @property
    def bytes_per_block(self) -> int:
        elem = ELEMENT_SIZES[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class CudaIpcHandle:
    """The fields of a torch CUDA IPC export of one allocation (mirrors memory.v1.CudaIpcHandle).

    Sent as plain fields, never pickled: a pickle from the wire would run the sender's code.
    """

    device_index: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class PoolDescriptor:
    """Everything another process needs to map the pool (mirrors memory.v1.PoolDescriptor)."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    shm_name: str | None = None
    cuda_ipc: CudaIpcHandle | None = None

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * ELEMENT_SIZES[self.dtype]


class KvPool(Protocol):
    """A KV pool owned by the memory service (CPU shared memory or a CUDA allocation)."""

    def descriptor(self) -> PoolDescriptor: ...

    def copy_block(self, src: int, dst: int) -> None: ...

    def close(self) -> None: ...


class SharedMemoryPool:
    """POSIX shared memory; the service owns it, holds its lock, unlinks it, and copies blocks in it
    as bytes (``tensor`` views it as a torch tensor, for tests).

    Not ``multiprocessing.shared_memory``: its resource tracker is a second process that unlinks
    the segment only if it outlives the service, and the segment's lock (module docstring) needs
    the file descriptor.
    """

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self._dtype = dtype
        self.shape = tuple(shape)
        num_bytes = math.prod(shape) * ELEMENT_SIZES[dtype]
        # (num_layers * 2) runs of num_blocks blocks, each block_bytes long (the layout's order)
        self._num_runs, self._num_blocks = shape[0] * shape[1], shape[2]
        self._block_bytes = math.prod(shape[3:]) * ELEMENT_SIZES[dtype]
        self._tensor: torch.Tensor | None = None
        self.name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self._path = SHM_DIR / self.name
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)  # held for life: marks the segment as not stale
            os.ftruncate(self._fd, num_bytes)
            # Every page allocated now: a /dev/shm too small fails here (ENOSPC) rather than as a
            # SIGBUS in whichever process first writes past what tmpfs could give.
            os.posix_fallocate(self._fd, 0, num_bytes)
            self._mmap = map_populated(self._fd, num_bytes)
        except BaseException:
            os.close(self._fd)
            self._path.unlink()
            raise

    @property
    def tensor(self) -> torch.Tensor:
        """The pool as a (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim) tensor over
        the same bytes (imports torch; the service itself never asks)."""
        if self._tensor is None:
            from pagedserve.dtypes import DTYPES

            import torch

            flat = torch.frombuffer(self._mmap, dtype=DTYPES[self._dtype], count=math.prod(self.shape))
            self._tensor = flat.view(self.shape)
        return self._tensor

    def descriptor(self) -> PoolDescriptor:
        return PoolDescriptor(shape=self.shape, dtype=self._dtype, device="cpu", shm_name=self.name)

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``src``'s bytes over block ``dst``'s, in every layer's K and V."""
        for block in (src, dst):
            if not 0 <= block < self._num_blocks:
                raise IndexError(f"block {block} is not in [0, {self._num_blocks})")
        size, run = self._block_bytes, self._num_blocks * self._block_bytes
        with memoryview(self._mmap) as view:
            for start in range(0, self._num_runs * run, run):
                view[start + dst * size:start + (dst + 1) * size] = view[start + src * size:start + (src + 1) * size]

    def close(self) -> None:
        self._tensor = None  # release the exported buffer before closing the mapping
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere in this process; the unlink below still frees the name
        self._path.unlink(missing_ok=True)
        os.close(self._fd)


class CudaPool:
    """One device allocation shared through torch's CUDA IPC (same device, other process)."""

    def __init__(self, shape: tuple[int, ...], dtype: str, device: str) -> None:
        import torch

        from pagedserve.dtypes import DTYPES

        self._dtype = dtype
        self.tensor = torch.zeros(shape, dtype=DTYPES[dtype], device=device)

    def descriptor(self) -> PoolDescriptor:
        storage = self.tensor._typed_storage()
        (device_index, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
            storage._share_cuda_()
        )
        ipc = CudaIpcHandle(
            device_index=int(device_index),
            storage_handle=bytes(handle),
            storage_size_bytes=int(size_bytes),
            storage_offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset),
            event_handle=bytes(event_handle) if event_handle else b"",
            event_sync_required=bool(event_sync),
        )
        return PoolDescriptor(shape=tuple(self.tensor.shape), dtype=self._dtype, device=str(self.tensor.device),
                              cuda_ipc=ipc)

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


def available_ram_bytes() -> int:
    """MemAvailable of /proc/meminfo (RAM the kernel can give without swapping)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def default_kv_budget(device: str, utilization: float) -> tuple[int, dict[str, int]]:
    """The pool's bytes when no size is given, and what it was chosen from (for the log).

    CUDA: ``utilization`` of the free GPU memory. CPU: the least of DEFAULT_CPU_KV_CAP_BYTES, a quarter
    of available RAM (the pool's pages are the machine's memory, and the model, the services and
    everything else on the host need theirs) and ``utilization`` of the free /dev/shm (a tmpfs: a
    larger segment SIGBUSes when written).
    """
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free * utilization), {"free_gpu_bytes": int(free)}
    sources = {"cap_bytes": DEFAULT_CPU_KV_CAP_BYTES, "quarter_available_ram_bytes": available_ram_bytes() // 4,
               "shm_share_bytes": int(shm_free_bytes() * utilization)}
    return min(sources.values()), sources


def shm_free_bytes() -> int:
    """Bytes still free in /dev/shm (a tmpfs: a segment larger than this SIGBUSes when written)."""
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def check_shm_space(num_bytes: int) -> None:
    """Refuses a pool that /dev/shm cannot hold: its pages are only claimed when first written.

    Raises:
        PreconditionError: naming both sizes and the flags that change them.
    """
    free = shm_free_bytes()
    if num_bytes > free:
        raise PreconditionError(
            f"the KV pool needs {num_bytes} bytes of /dev/shm but only {free} are free: "
            "lower --max-num-blocks or --kv-cache-bytes, or enlarge /dev/shm"
        )


def host_ram_bytes() -> int:
    """This machine's physical memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_tier_space(num_bytes: int) -> None:
    """Refuses a host tier (``--kv-host-bytes``) larger than the machine's RAM, at the start: its
    buffer is only allocated at the first trusted Attach, which would fail (INTERNAL) at every try.

    Raises:
        PreconditionError: naming both sizes and the flag.
    """
    ram = host_ram_bytes()
    if num_bytes > ram:
        raise PreconditionError(f"--kv-host-bytes {num_bytes} is more than this machine's RAM ({ram} bytes): "
                                "lower it")


def _pid_is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def remove_stale_segments() -> int:
    """Unlinks this user's pool segments whose service is gone (module docstring).

    Returns:
        How many segments were removed.
    """
    num_removed = 0
    for path in SHM_DIR.glob(f"{SHM_PREFIX}*"):
        if not SHM_NAME_PATTERN.fullmatch(path.name):
            continue
        pid = int(path.name[len(SHM_PREFIX) :].split("-")[0])
        if pid == os.getpid() or _pid_is_running(pid):
            continue  # also covers a live service between creating its segment and locking it
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live service (in another pid namespace) holds it
            path.unlink(missing_ok=True)
            num_removed += 1
        finally:
            os.close(fd)
    return num_removed
