"""The generated gRPC code must match protos/: regenerate into a temp dir and compare byte for byte.

The code is committed (readable in review, and nothing is generated at install: a wheel or a
`pip install <git url>` needs no grpcio-tools) and checked against the locked grpcio-tools only:
its output names the version that generated it, so another version's output differs by that line.
Where grpcio-tools moves (the canary, scripts/check_latest.sh, installs the newest), this test says
so: refresh the lock and run scripts/gen_protos.py together.
"""

import filecmp
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    [locked] = re.findall(r"^grpcio-tools==(\S+)", (ROOT / "requirements" / "lock.txt").read_text(), re.M)
    assert metadata.version("grpcio-tools") == locked, (
        f"grpcio-tools {metadata.version('grpcio-tools')} is installed, the lock has {locked}: the generated code "
        "is checked against the lock's (refresh the lock with scripts/lock.sh, then run scripts/gen_protos.py)")
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
