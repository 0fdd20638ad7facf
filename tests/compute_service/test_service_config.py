"""``python -m compute_service`` configuration: defaults < --config FILE < flags; bad values named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compute_service.__main__ import build_parser, configs_from_args, main
from compute_service.service.config import ComputeServiceConfig


def parse(*argv: str):
    return configs_from_args(build_parser().parse_args(list(argv)))


def test_defaults() -> None:
    service, engine = parse()
    assert (service.listen, service.model, service.max_queued_requests) == ("127.0.0.1:50052", "default", 256)
    assert (engine.max_num_seqs, engine.block_size, engine.memory_socket) == (64, 16, None)


def test_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "compute.json"
    path.write_text(json.dumps({"max_num_seqs": 8, "max_queued_requests": 5, "listen": "unix:/tmp/x.sock",
                                "block_size": 32, "memory_socket": "/tmp/m.sock"}))
    service, engine = parse("--config", str(path), "--max-num-seqs", "4", "--listen", "127.0.0.1:0")
    assert (service.listen, service.max_queued_requests, service.memory_socket) == ("127.0.0.1:0", 5, "/tmp/m.sock")
    assert (engine.max_num_seqs, engine.block_size, engine.memory_socket) == (4, 32, "/tmp/m.sock")


def test_a_file_shared_with_the_memory_service(tmp_path: Path) -> None:
    path = tmp_path / "pagedserve.json"
    path.write_text(json.dumps({"block_size": 32, "max_num_blocks": 100, "enable_prefix_caching": True,
                                "memory_utilization_threshold": 0.9, "socket": "/tmp/m.sock", "max_num_seqs": 8}))
    service, engine = parse("--config", str(path))
    assert (engine.block_size, engine.max_num_seqs, service.memory_socket) == (32, 8, "/tmp/m.sock")


def test_unknown_key_and_bad_values_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "compute.json"
    path.write_text(json.dumps({"max_num_seq": 8}))
    with pytest.raises(ValueError, match="max_num_seq"):
        parse("--config", str(path))
    with pytest.raises(ValueError, match="max_queued_requests"):
        ComputeServiceConfig(max_queued_requests=0)
    with pytest.raises(ValueError, match="listen"):
        ComputeServiceConfig(listen="nowhere")
    assert main(["--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


def test_parent_pid_ties_the_service_to_its_owner() -> None:
    # An owner that is not our parent (gone already): the service exits at once, before serving.
    done = subprocess.run([sys.executable, "-m", "compute_service", "--parent-pid", "1", "--listen", "127.0.0.1:0"],
                          capture_output=True, timeout=60)
    assert done.returncode == 1
