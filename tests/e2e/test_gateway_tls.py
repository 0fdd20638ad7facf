"""The gateway serves TLS when given a certificate and key: a self-signed
certificate made here with the openssl CLI, a client that trusts it, and a plaintext client refused."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.process import ServiceProcess, wait_until
from pagedserve.sockets import free_port
from pagedserve.stack import GATEWAY_SERVICE
from tests.e2e.conftest import Engine

PROBE = Path(__file__).resolve().parents[2] / "helm" / "pagedserve" / "files" / "health_probe.py"


def _self_signed(directory: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    cert, key = directory / "gateway.crt", directory / "gateway.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def _serving(channel: grpc.Channel) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=GATEWAY_SERVICE),
                                                          timeout=1)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_gateway_serves_tls_only(engines: list[Engine], run_dir: Path, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    address = f"127.0.0.1:{free_port()}"
    gateway = ServiceProcess("gateway", ["--backend", engines[0].address, "--listen", address,
                                         "--tls-cert", str(cert), "--tls-key", str(key), "--health-interval-s", "0.2"],
                             address=address, log_file=run_dir / "gateway-tls.log")
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    try:
        with grpc.secure_channel(address, credentials) as channel:
            def serving() -> bool:
                assert gateway.is_running(), "the TLS gateway exited"
                return _serving(channel)

            wait_until(serving, 60, "the TLS gateway serving")
            reply = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
                prompt="over tls", params=gateway_pb2.SamplingParams(max_tokens=3, temperature=0.0,
                                                                     ignore_eos=True)), timeout=30)
            assert reply.usage.completion_tokens == 3
        # The chart's exec readiness probe, as the kubelet runs it in a TLS gateway's pod.
        probe = subprocess.run([sys.executable, str(PROBE), "--tls-ca", str(cert), "--tls-server-name", "localhost",
                                address, GATEWAY_SERVICE], capture_output=True, text=True, timeout=30)
        assert probe.returncode == 0 and probe.stdout.strip() == "SERVING", probe.stderr
        with grpc.insecure_channel(address) as plain:  # no TLS: the handshake fails
            with pytest.raises(grpc.RpcError) as info:
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        untrusting = grpc.ssl_channel_credentials()  # the system's CAs only: the certificate is not theirs
        with grpc.secure_channel(address, untrusting) as channel:
            with pytest.raises(grpc.RpcError) as info:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert gateway.stop() == 0


def test_tls_flags_are_checked_at_start(tmp_path: Path) -> None:
    from gateway.config import GatewayConfig

    cert, _ = _self_signed(tmp_path)
    with pytest.raises(ValueError, match="give both"):
        GatewayConfig(backends=("h:1",), tls_cert_file=str(cert))
    with pytest.raises(ValueError, match="tls_key_file .* is not a readable file"):
        GatewayConfig(backends=("h:1",), tls_cert_file=str(cert), tls_key_file=str(tmp_path / "missing.key"))
