"""The backend switch: every op the model runs, as a torch reference or a Triton kernel.

Each module of `nano_spec_kernels` (the folder `kernels/`) defines `<name>_ref` (plain torch) and `<name>` (the
Triton launcher) with the same signature. `Ops("torch")` binds the references,
`Ops("triton")` the launchers; `"auto"` is triton on CUDA (when triton is installed)
and torch elsewhere. One exception: the torch backend's prefill scan runs prompts of
CHUNKED_FROM tokens or more as chunked SSD matmuls (ssd.py), not a Python loop over T.

Triton is optional: without it (macOS, Windows) the kernel modules still import
(nano_spec_kernels.common stands in for triton), so the torch backend works and
`Ops("triton")` is refused with a ValueError.
"""
import importlib

import torch

from nano_spec.model.ssd import mamba_scan_chunked
from nano_spec_kernels.common import HAS_TRITON
from nano_spec_kernels.mamba_scan import mamba_scan_ref

# the attributes of Ops, each bound from the kernel module of its name
OP_NAMES = ("rmsnorm", "gated_rmsnorm", "mamba_scan", "mamba_verify", "commit_state", "attention_prefill",
            "attention_verify", "attention_block", "gather_rows", "verdict_greedy", "verdict_sample")
MODULE_OF = {"attention_block": "attention_verify"}  # an op that lives in another op's module
BACKENDS = ("auto", "torch", "triton")
CHUNKED_FROM = 16  # below this many tokens the recurrence is the cheaper of the two on a CPU


def torch_prefill_scan(xBC, dt, *args):
    """mamba_scan_ref's contract; equal to fp32 rounding (tests/test_train.py)."""
    return (mamba_scan_chunked if xBC.shape[0] >= CHUNKED_FROM else mamba_scan_ref)(xBC, dt, *args)


def resolve_backend(backend: str, device: torch.device | str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        # a CUDA machine without triton (e.g. Windows) still runs, on the references
        return "triton" if torch.device(device).type == "cuda" and HAS_TRITON else "torch"
    return backend


class Ops:
    """A namespace of the ops of one backend: ops.rmsnorm(...), ops.mamba_verify(...), ..."""

    def __init__(self, backend: str = "torch"):
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend: {backend!r} must be 'torch' or 'triton' (resolve 'auto' first)")
        if backend == "triton" and not HAS_TRITON:
            raise ValueError("backend: 'triton' needs the triton package (Linux only); use backend='torch'")
        self.backend = backend
        for name in OP_NAMES:
            module = importlib.import_module(f"nano_spec_kernels.{MODULE_OF.get(name, name)}")
            setattr(self, name, getattr(module, name if backend == "triton" else f"{name}_ref"))
        if backend == "torch":
            self.mamba_scan = torch_prefill_scan

    def __repr__(self):
        return f"Ops({self.backend!r})"
