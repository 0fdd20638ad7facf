"""The engine: requests and sequences, sampling, scheduling, the model runner, the step loop, LLM."""
