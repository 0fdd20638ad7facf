"""What Info says of the memory service behind the engine (compute_service/service/convert.py, and a real pair)."""

from __future__ import annotations

from pathlib import Path

from compute_service.model.model_info import ModelInfo
from compute_service.service import convert
from memory_service.api import KvTierInfo
from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve_testing.tiny_model import ServiceModel
from tests.compute_service.service_fixtures import running_services

INFO = ModelInfo(model_name="m", max_model_len=64, dtype="float32", device="cpu", vocab_size=10, eos_token_ids=(1,),
                 bos_token_id=-1, pad_token_id=-1, chat_template="", tokenizer_files=(), kernels="torch-fallback")


def test_info_states_the_memory_service_and_its_tiers_in_blocks() -> None:
    msg = convert.info_to_pb(INFO, block_size=4, num_kv_blocks=32, memory_service_id="ms-1",
                             memory_service_epoch="e1", kv_tiers=(KvTierInfo("host", 1000), KvTierInfo("disk", 4096)),
                             bytes_per_block=256)
    assert (msg.memory_service_id, msg.memory_service_epoch, msg.num_kv_blocks) == ("ms-1", "e1", 32)
    assert [(t.kind, t.capacity_bytes, t.capacity_blocks) for t in msg.kv_tiers] == [
        ("host", 1000, 3), ("disk", 4096, 16)]


def test_info_of_an_unattached_engine_names_no_memory_service() -> None:
    msg = convert.info_to_pb(INFO, block_size=4, num_kv_blocks=0)
    assert msg.memory_service_id == "" and len(msg.kv_tiers) == 0


def test_a_compute_service_reports_its_memory_services_tier(service_model: ServiceModel, tmp_path: Path) -> None:
    """Over the wire: the memory service's id (kept in its tier directory) and its disk tier, in blocks
    of the model (2 layers x K,V x 4 tokens x 2 heads x 16 dims x 4 bytes = 2 KiB a block)."""
    tier_dir = tmp_path / "tier"
    memory_args = ("--max-num-blocks", "128", "--kv-disk-dir", str(tier_dir), "--kv-disk-bytes", str(1 << 20))
    with running_services(service_model.path, memory_args=memory_args) as services:
        info = services.stub.Info(cpb.InfoRequest(), timeout=10)
        load = services.stub.Load(cpb.LoadRequest(), timeout=10)
    assert load.memory_service_id == info.memory_service_id  # every poll, so a gateway sees a change
    assert load.memory_service_epoch == info.memory_service_epoch and len(info.memory_service_epoch) == 16
    assert info.memory_service_id == (tier_dir / "memory-service-id").read_text().strip()
    assert [(t.kind, t.capacity_bytes, t.capacity_blocks) for t in info.kv_tiers] == [("disk", 1 << 20, 512)]
