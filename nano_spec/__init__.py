"""nano_spec: a minimal speculative-decoding engine for hybrid Mamba2/attention models."""
from nano_spec.engine.llm import LLM, Output
from nano_spec.model.sampling import SamplingParams

__all__ = ["LLM", "Output", "SamplingParams"]
