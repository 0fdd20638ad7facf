"""The client maps only the pool its own layout needs, from a name of ours.

Before: a crafted ``shm_name`` such as ``../../some/file`` was mapped, grown and overwritten, and the
CUDA handle was unpickled (running whatever the sender put in it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from memory_service.pool.mapped_pool import MappedPool, check_descriptor
from memory_service.pool.kv_pool import CudaIpcHandle, PoolDescriptor, SharedMemoryPool
from pagedserve.memory.v1 import memory_pb2 as pb
from tests.memory_service.conftest import TINY_LAYOUT

SHAPE = TINY_LAYOUT.shape(4)


@pytest.fixture
def pool() -> SharedMemoryPool:
    pool = SharedMemoryPool(SHAPE, "float32")
    yield pool
    pool.close()


def test_a_good_descriptor_maps_the_same_bytes(pool: SharedMemoryPool) -> None:
    mapped = MappedPool(pool.descriptor(), TINY_LAYOUT, 4)
    mapped.tensor[1, 0, 3] = 7.0
    assert float(pool.tensor[1, 0, 3, 0, 0, 0]) == 7.0
    mapped.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copy_block_copies_one_block_of_every_layers_k_and_v(dtype: str) -> None:
    pool = SharedMemoryPool(SHAPE, dtype)
    try:
        torch.manual_seed(0)
        pool.tensor.copy_(torch.randn(SHAPE))
        expected = pool.tensor.clone()
        expected[:, :, 3] = expected[:, :, 1]
        pool.copy_block(1, 3)
        assert torch.equal(pool.tensor, expected)
        for src, dst in ((0, 4), (-1, 0)):
            with pytest.raises(IndexError, match="not in"):
                pool.copy_block(src, dst)
        assert torch.equal(pool.tensor, expected)
    finally:
        pool.close()


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "pagedserve-kv-1-0123456789abcdef/../x", "other-segment", "pagedserve-kv-1-XYZ"]
)
def test_foreign_segment_names_are_refused(tmp_path: Path, name: str) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"x" * 10)
    with pytest.raises(ValueError, match="shm_name"):
        MappedPool(PoolDescriptor(SHAPE, "float32", "cpu", shm_name=name), TINY_LAYOUT, 4)
    assert target.read_bytes() == b"x" * 10


def test_a_segment_of_the_wrong_size_is_refused_and_not_grown(pool: SharedMemoryPool) -> None:
    small = TINY_LAYOUT.shape(2)  # the service claims 2 blocks; our file holds 4: refuse, do not grow
    with pytest.raises(ValueError, match="holds"):
        MappedPool(PoolDescriptor(small, "float32", "cpu", shm_name=pool.name), TINY_LAYOUT, 2)
    size = os.stat(f"/dev/shm/{pool.name}").st_size
    assert size == pool.descriptor().num_bytes


@pytest.mark.parametrize(
    ("descriptor", "needle"),
    [
        (PoolDescriptor(TINY_LAYOUT.shape(5), "float32", "cpu", shm_name="pagedserve-kv-1-0123456789abcdef"), "shape"),
        (PoolDescriptor(SHAPE, "float16", "cpu", shm_name="pagedserve-kv-1-0123456789abcdef"), "dtype"),
        (PoolDescriptor(SHAPE, "float32", "cpu"), "exactly one"),
        (PoolDescriptor(SHAPE, "float32", "cuda:0", shm_name="pagedserve-kv-1-0123456789abcdef"), "cpu"),
        (PoolDescriptor(SHAPE, "float32", "cuda:1", cuda_ipc=CudaIpcHandle(0, b"h", 1 << 20, 0, b"r", 0, b"", False)),
         "does not match"),
        (PoolDescriptor(SHAPE, "float32", "cuda:0", cuda_ipc=CudaIpcHandle(0, b"h", 16, 0, b"r", 0, b"", False)),
         "smaller"),
    ],
)
def test_descriptors_that_are_not_our_pool_are_refused(descriptor: PoolDescriptor, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        check_descriptor(descriptor, TINY_LAYOUT, 4)


def test_the_wire_carries_no_pickle() -> None:
    fields = pb.PoolDescriptor.DESCRIPTOR.fields_by_name
    assert "cuda_ipc_handle" not in fields
    assert fields["cuda_ipc"].message_type.name == "CudaIpcHandle"
    assert all(f.type != f.TYPE_BYTES or f.name.endswith("handle") for f in pb.CudaIpcHandle.DESCRIPTOR.fields)


def resident_bytes(address: int) -> int:
    """Rss of this process's mapping that holds ``address`` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if not head.endswith(":"):  # a mapping's first line: "start-end perms offset dev inode path"
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_both_mappings_are_populated_before_the_first_step() -> None:
    """Before: every page of the pool faulted in when a step first wrote K/V into it (30 ms of a
    1.05 s prefill step of the default model), and a /dev/shm too small only showed as a SIGBUS."""
    num_blocks = 1024  # 512 KiB
    pool = SharedMemoryPool(TINY_LAYOUT.shape(num_blocks), "float32")
    try:
        num_bytes = pool.descriptor().num_bytes
        assert num_bytes >= 64 * 4096
        assert os.stat(f"/dev/shm/{pool.name}").st_blocks * 512 >= num_bytes  # allocated, not sparse
        assert resident_bytes(pool.tensor.data_ptr()) >= num_bytes
        mapped = MappedPool(pool.descriptor(), TINY_LAYOUT, num_blocks)
        assert resident_bytes(mapped.tensor.data_ptr()) >= num_bytes
        mapped.close()
    finally:
        pool.close()
