"""out[b] = src[b, idx[b]]: the stash-slot hidden save that seeds the MTP draft head
(the hidden of the last accepted row), also used on the MTP's own output rows.

The kernel is a strided copy: program (b, i) reads the idx[b]-th row of batch entry b
in blocks of BLOCK_D and writes them to out[b]. idx stays on the device (no host sync).
"""
import torch
import triton
import triton.language as tl


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
    """Triton version of gather_rows_ref: src (B, K, D), idx (B,) int -> (B, D).
    idx must lie in [0, K) (not checked: that would need a host sync)."""
    if src.dim() != 3:
        raise ValueError(f"src must be (B, K, D), got {tuple(src.shape)}")
    Bsz, K, D = src.shape
    if idx.shape != (Bsz,) or idx.is_floating_point() or idx.dtype == torch.bool:
        raise ValueError(f"idx must be an integer tensor of shape ({Bsz},), got {idx.dtype} {tuple(idx.shape)}")
    if idx.device != src.device:
        raise ValueError(f"idx on {idx.device} but src on {src.device}")
    if src.stride(-1) != 1:
        raise ValueError("src must have a unit stride in its last dim")
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
