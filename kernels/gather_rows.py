"""One row per sequence: out[b] = src[b, idx[b]], src (B, K, D), idx (B,) -> out (B, D).

What it is for: the stash-slot hidden save of the MTP proposer. After a verify over
K rows, the MTP catch-up runs over the K verified rows of every sequence and gives
its outputs (B, K, D); the row at the last accepted position, idx[b] = na[b], is
the one that seeds the next drafts, so it is taken out here while na stays on the
device (no host sync on the verdict).

The kernel is a strided copy: program (b, i) reads block i (BLOCK_D elements) of
row idx[b] of batch entry b and writes it to out[b].
"""
import functools

import torch

from kernels.common import check, tl, triton

_check = functools.partial(check, "gather_rows")


@triton.jit
def _gather_rows_kernel(p_src, p_idx, p_out, D, s_src_b, s_src_k, s_out_b, BLOCK_D: tl.constexpr):
    """grid (B, cdiv(D, BLOCK_D))."""
    i_b, i_d = tl.program_id(0), tl.program_id(1)
    i_k = tl.load(p_idx + i_b).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_x = tl.load(p_src + i_b * s_src_b + i_k * s_src_k + o_d, mask=m_d)  # (BLOCK_D,)
    tl.store(p_out + i_b * s_out_b + o_d, b_x, mask=m_d)


def gather_rows(src, idx):
    """Triton version of gather_rows_ref: src (B, K, D) with unit last-dim stride, idx (B,) contiguous
    integer on src's device -> new contiguous (B, D). idx must lie in [0, K) (not checked: that would
    need a host sync)."""
    _check(src.dim() == 3, f"src must be (B, K, D), got {tuple(src.shape)}")
    Bsz, K, D = src.shape
    _check(idx.shape == (Bsz,) and not idx.is_floating_point() and idx.dtype != torch.bool,
           f"idx must be an integer tensor of shape ({Bsz},), got {idx.dtype} {tuple(idx.shape)}")
    _check(idx.device == src.device, f"idx on {idx.device} but src on {src.device}")
    _check(src.stride(-1) == 1, "src must have a unit stride in its last dim")
    _check(idx.is_contiguous(), "idx must be contiguous")  # the kernel reads idx[b] at offset b
    out = torch.empty((Bsz, D), dtype=src.dtype, device=src.device)
    if Bsz == 0 or D == 0:
        return out
    BLOCK_D = min(1024, triton.next_power_of_2(D))
    _gather_rows_kernel[(Bsz, triton.cdiv(D, BLOCK_D))](
        src, idx, out, D, src.stride(0), src.stride(1), out.stride(0), BLOCK_D=BLOCK_D,
    )
    return out


def gather_rows_ref(src, idx):
    """src (B, K, D), idx (B,) int -> (B, D)."""
    return src[torch.arange(src.shape[0], device=src.device), idx]
