"""The gRPC service around the engine: servicer, server, engine loop thread, protobuf conversion, metrics."""
