"""Helpers shared by the tests and the benchmarks, never imported by a service.

- ``tiny_model``: a tiny random-weight Llama with a byte-level tokenizer, built in seconds;
- ``stack``: a whole stack of real processes (memory, compute, gateway) with the checks every
  scenario ends with (blocks accounted for, nothing leaked);
- ``fuzz``, ``fuzz_requests``: a seeded generator of hostile requests and its runner;
- ``load``: concurrent streaming clients, an overload burst, request churn;

They live here rather than in ``benchmarks/`` so that the tests depend on no benchmark code, and
rather than in ``tests/`` so that the benchmarks' quick modes can use them too (benchmarks never
import tests). Their own package, above the services rather than inside ``pagedserve/``: the kit
knows what it starts (``stack.kv_layout`` reads the compute service's model config), while the shared
floor below the services imports none of them (tests/test_imports.py holds both rules).
"""
