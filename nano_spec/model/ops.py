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
import torch
import torch.nn as nn

from nano_spec.model.ssd import mamba_scan_chunked
from nano_spec_kernels import (attention_prefill, attention_verify, commit_state, gated_rmsnorm, gather_rows,
                               mamba_scan, mamba_verify, rmsnorm, verdict_greedy, verdict_sample)
from nano_spec_kernels.common import HAS_TRITON

# the attributes of Ops
OP_NAMES = ("rmsnorm", "gated_rmsnorm", "mamba_scan", "mamba_verify", "commit_state", "attention_prefill",
            "attention_verify", "attention_block", "gather_rows", "verdict_greedy", "verdict_sample")
BACKENDS = ("auto", "torch", "triton")
CHUNKED_FROM = 16  # below this many tokens the recurrence is the cheaper of the two on a CPU


class Norm(nn.Module):
    """Holds an RMSNorm weight; the math is ops.rmsnorm / ops.gated_rmsnorm (here, so the DFlash drafter's network
    uses it without the target's model module)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def torch_prefill_scan(xBC, dt, *args):
    """mamba_scan_ref's contract; equal to fp32 rounding (tests/test_train.py)."""
    return (mamba_scan_chunked if xBC.shape[0] >= CHUNKED_FROM else mamba_scan.mamba_scan_ref)(xBC, dt, *args)


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
        triton = backend == "triton"
        pick = lambda launcher, reference: launcher if triton else reference  # noqa: E731
        self.rmsnorm = pick(rmsnorm.rmsnorm, rmsnorm.rmsnorm_ref)
        self.gated_rmsnorm = pick(gated_rmsnorm.gated_rmsnorm, gated_rmsnorm.gated_rmsnorm_ref)
        self.mamba_scan = pick(mamba_scan.mamba_scan, torch_prefill_scan)
        self.mamba_verify = pick(mamba_verify.mamba_verify, mamba_verify.mamba_verify_ref)
        self.commit_state = pick(commit_state.commit_state, commit_state.commit_state_ref)
        self.attention_prefill = pick(attention_prefill.attention_prefill, attention_prefill.attention_prefill_ref)
        self.attention_verify = pick(attention_verify.attention_verify, attention_verify.attention_verify_ref)
        self.attention_block = pick(attention_verify.attention_block, attention_verify.attention_block_ref)
        self.gather_rows = pick(gather_rows.gather_rows, gather_rows.gather_rows_ref)
        self.verdict_greedy = pick(verdict_greedy.verdict_greedy, verdict_greedy.verdict_greedy_ref)
        self.verdict_sample = pick(verdict_sample.verdict_sample, verdict_sample.verdict_sample_ref)

    def __repr__(self):
        return f"Ops({self.backend!r})"
