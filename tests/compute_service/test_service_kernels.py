"""A compute service without usable fused CPU kernels (as in an image that ships none for its CPU and
has no compiler) serves, but never silently: an error at start, "torch-fallback" in Info and metrics."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

from pagedserve.compute.v1 import compute_pb2 as cpb
from pagedserve_testing.tiny_model import ServiceModel, hf_greedy
from tests.compute_service.service_fixtures import running_services

PROMPT = [40, 97, 109, 32, 97, 32, 116, 105, 110, 121]


def test_a_service_without_usable_kernels_says_so(service_model: ServiceModel, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    log = tmp_path / "compute.log"
    env = {"PAGEDSERVE_CPU_OPS_PREBUILT": str(prebuilt), "CXX": str(tmp_path / "no-compiler"),
           "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache"), "PAGEDSERVE_CPU_KERNELS": "1"}
    with running_services(service_model.path, compute_args=("--metrics-port", str(metrics_port), "--log-level",
                                                            "info", "--log-format", "json"),
                          compute_log=log, compute_env=env) as services:
        assert services.stub.Info(cpb.InfoRequest()).kernels == "torch-fallback"
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        assert 'pagedserve_compute_kernels{level="",path="torch-fallback"} 1.0' in metrics.splitlines()
        # It still serves, the same tokens on the slower path.
        tokens = [t for r in services.generate(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
                  for t in r.token_ids]
        assert tokens == hf_greedy(service_model.hf_model, PROMPT, 4)
    lines = log.read_text().splitlines()
    [error] = [line for line in lines if line.startswith("ERROR pagedserve_kernels.cpu_ops")]
    assert "no usable fused CPU kernels: serving on the slower PyTorch path (torch-fallback)" in error
    assert f"in {prebuilt} (it holds: nothing)" in error and "no C++ compiler" in error
    assert any('"event": "compute_kernels"' in line and '"level": "error"' in line
               and '"kernels": "torch-fallback"' in line for line in lines), lines[-20:]
