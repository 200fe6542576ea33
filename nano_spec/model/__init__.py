"""The target model: its config, weights and math, the caches it runs on, and the op table of kernels."""
