"""nano_spec_kernels (the folder kernels/): one file per kernel with the Triton kernel, its launcher and a plain-torch
reference `<name>_ref` of the same signature; shared helpers live in `nano_spec_kernels.common`.
Nothing here imports `nano_spec`, and every module imports without triton (the references work,
the launchers raise an ImportError): `nano_spec.model.ops` picks references or launchers.
"""
