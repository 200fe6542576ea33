"""nano_spec: a minimal speculative-decoding engine for hybrid Mamba2/attention models."""
