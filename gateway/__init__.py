"""The gateway: pagedserve's public gRPC API (``pagedserve.gateway.v1.Gateway``), stateless, in front
of any number of compute services: validation, tokenization, routing, streaming, auth, metrics."""
