"""What Info says of the memory service behind the engine (compute_service/service/convert.py)."""

from __future__ import annotations

from compute_service.model.model_info import ModelInfo
from compute_service.service import convert
from memory_service.api import KvTierInfo

INFO = ModelInfo(model_name="m", max_model_len=64, dtype="float32", device="cpu", vocab_size=10, eos_token_ids=(1,),
                 bos_token_id=-1, pad_token_id=-1, chat_template="", tokenizer_files=(), kernels="torch-fallback")


def test_info_states_the_memory_service_and_its_tiers_in_blocks() -> None:
    msg = convert.info_to_pb(INFO, block_size=4, num_kv_blocks=32, memory_service_id="ms-1",
                             kv_tiers=(KvTierInfo("host", 1000), KvTierInfo("disk", 4096)), bytes_per_block=256)
    assert msg.memory_service_id == "ms-1" and msg.num_kv_blocks == 32
    assert [(t.kind, t.capacity_bytes, t.capacity_blocks) for t in msg.kv_tiers] == [
        ("host", 1000, 3), ("disk", 4096, 16)]


def test_info_of_an_unattached_engine_names_no_memory_service() -> None:
    msg = convert.info_to_pb(INFO, block_size=4, num_kv_blocks=0)
    assert msg.memory_service_id == "" and len(msg.kv_tiers) == 0
