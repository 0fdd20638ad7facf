"""The generated gRPC code must match protos/: regenerate into a temp dir and compare byte for byte."""

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "gen_protos.py produced nothing"
    stale = [str(rel) for rel in generated if not filecmp.cmp(tmp_path / rel, ROOT / rel, shallow=False)]
    assert not stale, f"generated code is stale, run scripts/gen_protos.py: {stale}"


def test_proto_packages_and_services() -> None:
    from pagedserve.compute.v1 import compute_pb2
    from pagedserve.gateway.v1 import gateway_pb2
    from pagedserve.memory.v1 import memory_pb2

    assert memory_pb2.DESCRIPTOR.services_by_name["MemoryManager"].full_name == "pagedserve.memory.v1.MemoryManager"
    assert compute_pb2.DESCRIPTOR.services_by_name["Compute"].full_name == "pagedserve.compute.v1.Compute"
    assert gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name == "pagedserve.gateway.v1.Gateway"
    fields = {f.name for f in gateway_pb2.GenerateRequest.DESCRIPTOR.fields}
    assert {"prompt", "messages", "params", "priority", "request_id", "cache_salt"} <= fields


def test_transformers_does_not_mistake_our_kernels_package() -> None:
    import kernels  # noqa: F401  (ours is importable)
    from transformers.utils import import_utils

    import_utils.is_kernels_available.cache_clear()
    assert import_utils.is_kernels_available() is False
