"""The roofline on paper (roofline.py), which `python -m nano_spec_kernels.bench --predict` runs: it reads the model
configs from nano_spec. The kernel bench itself is the kernels package's own (kernels/nano_spec_kernels/bench.py)."""
