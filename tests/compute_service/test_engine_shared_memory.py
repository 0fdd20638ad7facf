"""Two engines on one memory service: a request that waits for blocks another client holds is
admitted once that client frees them (the engine re-reads the counts; it never starves)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from compute_service import LLM, SamplingParams
from compute_service.engine.outputs import RequestOutput, collect
from tests.compute_service.service_fixtures import start_memory
from tests.conftest import TinyModel

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_waiting_request_is_admitted_when_another_client_frees(make_tiny_model: Callable[[str], TinyModel],
                                                              tmp_path: Path) -> None:
    socket = tmp_path / "memory.sock"
    model = str(make_tiny_model("llama").path)
    with start_memory(socket, "--max-num-blocks", "16", "--enable-prefix-caching", "false"):
        with LLM(model, dtype="float32", block_size=4, memory_socket=str(socket)) as a, \
                LLM(model, dtype="float32", block_size=4, memory_socket=str(socket)) as b:
            a.engine.add_request("big", list(range(3, 3 + 52)), PARAMS)  # 13 of the 16 blocks
            a.engine.step()
            b.engine.add_request("small", list(range(3, 3 + 20)), PARAMS)  # 5 blocks: waits
            assert b.engine.step() == [] and b.engine.scheduler.waiting
            assert a.engine.abort("big")
            a.engine.step()  # reports the abort
            a.engine.step()  # frees big's blocks
            done = {}
            results: dict[str, RequestOutput] = {}
            for _ in range(20):
                done.update({o.request_id: o for o in collect(results, b.engine.step())})
                if done:
                    break
            assert len(done["small"].token_ids) == 4


def test_llm_passes_the_whole_pool_config_to_its_private_memory_service(
        make_tiny_model: Callable[[str], TinyModel]) -> None:
    """Every pool setting reaches the private service (here the reserved share: 4 of 16 blocks), the
    block size is the engine's; pool settings for a service LLM does not own are refused."""
    from memory_service.config import MemoryServiceConfig

    model = str(make_tiny_model("llama").path)
    with LLM(model, dtype="float32", block_size=4, max_num_blocks=16, reserved_fraction=0.25, max_num_seqs=2) as llm:
        assert llm._memory_process.config.block_size == 4
        assert [pool.num_total_blocks for pool in llm.memory_stats().pools] == [12, 4]
    with LLM(model, dtype="float32",
             block_size=4, memory=MemoryServiceConfig(max_num_blocks=8, enable_prefix_caching=False)) as llm:
        assert sum(pool.num_total_blocks for pool in llm.memory_stats().pools) == 8
        assert not llm._memory_process.config.enable_prefix_caching
    with pytest.raises(ValueError, match="max_num_blocks"):
        LLM(model, dtype="float32", memory_socket="/nonexistent/memory.sock", max_num_blocks=16)
