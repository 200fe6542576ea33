"""The Mamba2 output norm: gate first, then RMSNorm per group, then weight.

    u = y * silu(z);  u_g = u_g / sqrt(mean(u_g^2) + eps) for each group g of size d_in/G;  out = weight * u

The Triton version runs one program per (row, group), all math in fp32; the normalised
group rounds to z's dtype before the weight, as in the reference.
"""
import torch
import torch.nn.functional as F

from nano_spec_kernels.common import FLOAT, ROW, Arg, Checker, Launch, launch, rms_normalize, silu, tl, triton

_check = Checker("gated_rmsnorm")
_ARGS = {"y, z": Arg("... d_in", FLOAT, ROW), "weight": Arg("d_in")}


def gated_rmsnorm_ref(y, z, weight, group_size: int, eps: float):
    """y, z (..., d_in), weight (d_in,) -> (..., d_in) in z's dtype."""
    u = y.float() * F.silu(z.float())
    *lead, d_in = u.shape
    g = u.view(*lead, d_in // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(*lead, d_in).to(z.dtype)


@triton.jit
def _gated_rmsnorm_kernel(p_y, p_z, p_w, p_out, d_in, group_size, eps, stride_y, stride_z, BLOCK: tl.constexpr):
    i_m, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o = i_g * group_size + tl.arange(0, BLOCK)  # channels of group g
    m = tl.arange(0, BLOCK) < group_size
    b_y = tl.load(p_y + i_m * stride_y + o, mask=m, other=0.0).to(tl.float32)
    b_z = tl.load(p_z + i_m * stride_z + o, mask=m, other=0.0)
    b_u = b_y * silu(b_z.to(tl.float32))
    b_n = rms_normalize(b_u, group_size, eps, b_z.dtype)
    b_w = tl.load(p_w + o, mask=m, other=0.0).to(tl.float32)
    tl.store(p_out + i_m * d_in + o, (b_w * b_n).to(p_out.dtype.element_ty), mask=m)


def gated_rmsnorm_plan(y, z, weight, group_size: int, eps: float, *, cuda: bool, n_sm: int):
    d_in = _check.args(_ARGS, y=y, z=z, weight=weight).d_in
    _check(group_size >= 1 and d_in % group_size == 0, f"d_in={d_in} not divisible by group_size={group_size}")
    out = torch.empty(z.shape, dtype=torch.promote_types(weight.dtype, z.dtype), device=z.device)
    y2, z2 = y.reshape(-1, d_in), z.reshape(-1, d_in)
    if y2.shape[0] == 0 or d_in == 0:
        return [], out
    BLOCK = triton.next_power_of_2(group_size)  # a group in one block
    return [Launch(_gated_rmsnorm_kernel, (y2.shape[0], d_in // group_size),
                   (y2, z2, weight, out, d_in, group_size, float(eps), y2.stride(0), z2.stride(0)),
                   dict(BLOCK=BLOCK, num_warps=min(16, max(1, BLOCK // 256))))], out


def gated_rmsnorm(y, z, weight, group_size: int, eps: float):
    """Triton version of gated_rmsnorm_ref: y, z (..., d_in) with unit last-dim stride (leading dims
    reshaped), weight (d_in,) contiguous; d_in % group_size == 0 -> new contiguous (..., d_in)."""
    return launch(gated_rmsnorm_plan, y, z, weight, group_size, eps)


def gated_rmsnorm_bytes(rows: int, d_in: int, act: int, param: int | None = None) -> dict:
    """The bytes one call moves, by tensor: y and z read, the weight read once, the output written; act bytes
    an element of y and z, param of the weight (act when None), the output in the wider of the two."""
    param = act if param is None else param
    return {"y, z": 2 * rows * d_in * act, "weight": d_in * param, "out": rows * d_in * max(act, param)}
