"""The CUDA pool: a device allocation shared with another process through torch's CUDA IPC."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memory_service.manager.block_manager import AllocateOp
from memory_service.client import MemoryClient
from tests.memory_service.conftest import TINY_LAYOUT, start_memory_service

ROOT = Path(__file__).resolve().parents[2]

WRITER = """
import sys, torch
from memory_service.manager.block_manager import AllocateOp
from memory_service.client import MemoryClient
from memory_service.pool.kv_pool import KvLayout
layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", block_size=4)
client = MemoryClient("unix:" + sys.argv[1], layout, "writer")
assert client.pool.is_cuda
[r] = client.step([AllocateOp("w", list(range(8)), 8)])
client.pool[0, 1, r.block_ids[0]] = torch.full((4, 2, 4), 7.0, device=client.pool.device)
torch.cuda.synchronize()
print(r.block_ids[0], flush=True)
"""


@pytest.mark.cuda
def test_cuda_ipc_pool_is_shared_between_processes() -> None:
    proc, socket = start_memory_service("--max-num-blocks", "16", "--device", "cuda")
    try:
        out = subprocess.run([sys.executable, "-c", WRITER, socket], capture_output=True, text=True, check=True,
                             cwd=ROOT)
        block = int(out.stdout.split()[0])
        with MemoryClient(f"unix:{socket}", TINY_LAYOUT, "reader") as reader:
            assert reader.pool.is_cuda
            assert torch.equal(reader.pool[0, 1, block].cpu(), torch.full((4, 2, 4), 7.0))
            # Copy-on-write happens on the device, inside the service.
            [a] = reader.step([AllocateOp("a", [1, 2, 3], 3)])
            reader.pool[:, :, a.block_ids[0]] = 3.0
            torch.cuda.synchronize()
            from memory_service.manager.block_manager import AppendOp, ForkOp

            results = reader.step([ForkOp("a", "b"), AppendOp("b", [4])])
            [(src, dst)] = results[1].copies
            assert src == a.block_ids[0]
            assert torch.equal(reader.pool[:, :, dst].cpu(), reader.pool[:, :, src].cpu())
    finally:
        proc.terminate()
        proc.wait(timeout=10)
