"""nano_spec kernels: one file per kernel, each holding the Triton kernel, its
launcher and a plain-torch reference `<name>_ref` with the same signature.
Helpers used by several kernels live in `kernels.common`.

This package imports nothing from `nano_spec`; `nano_spec.ops` picks the
references (torch backend) or the launchers (triton backend). Every module
imports without triton (see `kernels.common`): the references then work and the
launchers raise an ImportError.
"""
