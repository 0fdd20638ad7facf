"""Exit 0 when the gRPC server at ADDRESS answers grpc.health.v1 Check with SERVING.

Used as an exec probe for the memory service, whose gRPC server listens only on a Unix socket
that the kubelet's native gRPC probe cannot reach. Usage: health_probe.py ADDRESS [SERVICE]
(ADDRESS like unix:/run/pagedserve/memory/memory.sock or host:port; SERVICE defaults to "").
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    service = argv[2] if len(argv) == 3 else ""
    with grpc.insecure_channel(argv[1]) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3.0
            )
        except grpc.RpcError as exc:
            print(f"health check of {argv[1]} failed: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
