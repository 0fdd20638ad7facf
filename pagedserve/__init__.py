"""pagedserve: an LLM inference server built around PagedAttention.

This package holds what the three services share: logging, config loading, gRPC server helpers,
the one launcher of service processes (``stack``), and the code generated from protos/
(``pagedserve.<service>.v1``). It is the ground floor: it imports no service, nor what stands on
them (the command line and ``up`` in pagedserve_cli, the test kit in pagedserve_testing).
"""
