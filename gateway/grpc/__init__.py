"""The public gRPC front (``pagedserve.gateway.v1.Gateway``): ``servicer`` converts each call with
``convert`` (from_pb/to_pb), runs it through ``GatewayCore`` and converts the answer back.

This package's name shadows nothing: every import in the repository is absolute, so ``import grpc``
is always the grpcio library. Nothing is imported here.
"""
