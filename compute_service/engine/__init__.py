"""The engine: requests and sequences, sampling, scheduling, the model runner, the step loop, and the
KV allocator it runs on (allocator.py). Starts no process: ``LLM`` (compute_service/llm.py) does."""
