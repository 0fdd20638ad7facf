"""The ``pagedserve`` command (``cli``) and ``pagedserve up`` (``up``), the supervisor that starts the
three services on one machine.

A package of its own, above the services: ``up`` takes each pass-through flag's type, help and
validation from the service's own config (memory_service, compute_service, gateway), so it depends on
what it starts, while ``pagedserve`` below them imports none of them. It starts them through the
ground floor's one launcher, pagedserve/stack.py, as the tests and the benchmarks do.
"""
