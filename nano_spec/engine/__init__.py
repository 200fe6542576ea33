"""The engine: the LLM API, the scheduler loop, the model runner and what they decide with (γ, threads, memory)."""
