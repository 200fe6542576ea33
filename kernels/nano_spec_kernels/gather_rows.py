"""One row per sequence: out[b] = src[b, idx[b]], src (B, K, D), idx (B,) -> out (B, D).

It takes the MTP proposer's seed: of the catch-up outputs (B, K, D) over the K verified rows, the
row at the last accepted position idx[b] = na[b], with na left on the device (no host sync).
Program (b, i) copies block i (BLOCK_D elements) of that row to out[b].
"""
import torch

from nano_spec_kernels.common import INT, ROW, Arg, Checker, Launch, launch, tl, triton

_check = Checker("gather_rows")
_ARGS = {"src": Arg("B K D", layout=ROW), "idx": Arg("B", INT)}


def gather_rows_ref(src, idx):
    """src (B, K, D), idx (B,) int -> (B, D)."""
    return src[torch.arange(src.shape[0], device=src.device), idx]


@triton.jit
def _gather_rows_kernel(p_src, p_idx, p_out, D, s_src_b, s_src_k, s_out_b, BLOCK_D: tl.constexpr):
    i_b, i_d = tl.program_id(0), tl.program_id(1)
    i_k = tl.load(p_idx + i_b).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_x = tl.load(p_src + i_b * s_src_b + i_k * s_src_k + o_d, mask=m_d)  # (BLOCK_D,)
    tl.store(p_out + i_b * s_out_b + o_d, b_x, mask=m_d)


def gather_rows_plan(src, idx, *, cuda: bool, n_sm: int):
    d = _check.args(_ARGS, src=src, idx=idx)
    Bsz, D = d.B, d.D
    out = torch.empty((Bsz, D), dtype=src.dtype, device=src.device)
    if Bsz == 0 or D == 0:
        return [], out
    meta = dict(BLOCK_D=min(1024, triton.next_power_of_2(D)), num_warps=4)
    return [Launch(_gather_rows_kernel, (Bsz, triton.cdiv(D, meta["BLOCK_D"])),
                   (src, idx, out, D, src.stride(0), src.stride(1), out.stride(0)), meta)], out


def gather_rows(src, idx):
    """Triton version of gather_rows_ref; idx must lie in [0, K) (not checked: a host sync)."""
    return launch(gather_rows_plan, src, idx)


def gather_rows_bytes(B: int, D: int, act: int) -> dict:
    """The bytes one call moves, by tensor: one row of D elements (act bytes) read and written per sequence."""
    return {"src rows": B * D * act, "idx": B * 8, "out": B * D * act}
