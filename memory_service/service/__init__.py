"""The gRPC service around the block manager: servicer, server, metrics."""
