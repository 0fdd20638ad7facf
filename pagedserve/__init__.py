"""pagedserve: an LLM inference server built around PagedAttention.

This package holds what the three services share: logging, config loading, gRPC server helpers,
the command line, and the code generated from protos/ (``pagedserve.<service>.v1``).
"""
