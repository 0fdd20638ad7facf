"""Exit 0 when the gRPC server at ADDRESS answers grpc.health.v1 Check with SERVING.

Used as an exec probe where the kubelet's native gRPC probe cannot reach: the memory service,
whose gRPC server listens only on a Unix socket, and a gateway that serves TLS (the native probe
speaks plaintext only). Usage: health_probe.py [--tls-ca FILE --tls-server-name NAME] ADDRESS
[SERVICE] (ADDRESS like unix:/run/pagedserve/memory/memory.sock or host:port; SERVICE defaults to "").

As the gateway's liveness probe (``--alive --http-port PORT``) it asks whether both fronts still
answer at all: any health status counts (NOT_SERVING while no engine is ready is a readiness
matter, and a restart would not help), but no answer within the timeout does. A TCP probe cannot
tell: the kernel completes the handshake into the listen backlog even when the process is stuck
or out of descriptors.
"""

import argparse
import socket
import ssl
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def grpc_status(args: argparse.Namespace) -> str | None:
    """The health status the server answers (its name), or None when it does not answer."""
    if args.tls_ca:
        with open(args.tls_ca, "rb") as handle:
            credentials = grpc.ssl_channel_credentials(root_certificates=handle.read())
        options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
        channel = grpc.secure_channel(args.address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=TIMEOUT_S
            )
        except grpc.RpcError as exc:
            print(f"health check of {args.address} failed: {exc.code().name}", file=sys.stderr)
            return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def http_status(port: int, tls_ca: str | None, server_name: str | None) -> int | None:
    """The HTTP status of ``GET /health`` on this host's ``port``, or None when nothing answers in time."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as raw:
            conn = raw
            if tls_ca:
                conn = ssl.create_default_context(cafile=tls_ca).wrap_socket(
                    raw, server_hostname=server_name or "localhost")
            # Host: localhost, a loopback name, which a keyless gateway accepts.
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            status_line = conn.makefile("rb").readline()
    except OSError as exc:  # refused, timed out, reset, TLS failure
        print(f"HTTP health check on port {port} failed: {exc!r}", file=sys.stderr)
        return None
    parts = status_line.split()
    if len(parts) < 2 or not parts[1].isdigit():
        print(f"HTTP health check on port {port}: no status line ({status_line[:80]!r})", file=sys.stderr)
        return None
    return int(parts[1])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tls-ca", help="PEM file of the certificate (or its CA) the server must present")
    parser.add_argument("--tls-server-name", help="a name the server's certificate is valid for")
    parser.add_argument("--alive", action="store_true",
                        help="liveness: any answer counts (NOT_SERVING too); only no answer in time fails")
    parser.add_argument("--http-port", type=int, help="also GET /health on this port of 127.0.0.1 (the HTTP front)")
    parser.add_argument("address")
    parser.add_argument("service", nargs="?", default="")
    args = parser.parse_args(argv[1:])
    status = grpc_status(args)
    if status is None:
        return 1
    print(status)
    if status != "SERVING" and not args.alive:
        return 1
    if args.http_port is not None:
        code = http_status(args.http_port, args.tls_ca, args.tls_server_name)
        if code is None or (code != 200 and not args.alive):
            return 1
        print(f"HTTP {code}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
