"""Exit 0 when the gRPC server at ADDRESS answers grpc.health.v1 Check with SERVING.

Used as an exec probe where the kubelet's native gRPC probe cannot reach: the memory service,
whose gRPC server listens only on a Unix socket, and a gateway that serves TLS (the native probe
speaks plaintext only). Usage: health_probe.py [--tls-ca FILE --tls-server-name NAME] ADDRESS
[SERVICE] (ADDRESS like unix:/run/pagedserve/memory/memory.sock or host:port; SERVICE defaults to "").
"""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tls-ca", help="PEM file of the certificate (or its CA) the server must present")
    parser.add_argument("--tls-server-name", help="a name the server's certificate is valid for")
    parser.add_argument("address")
    parser.add_argument("service", nargs="?", default="")
    args = parser.parse_args(argv[1:])
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
                health_pb2.HealthCheckRequest(service=args.service), timeout=3.0
            )
        except grpc.RpcError as exc:
            print(f"health check of {args.address} failed: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
