"""RMSNorm with an optional fused residual add.

    h = residual + multiplier * x      (or h = x without a residual)
    y = weight * h / sqrt(mean(h^2) + eps)      computed in fp32

Returns (y, h): the decoder loop keeps h as the residual stream and feeds y to the next mixer or MLP, so one
pass over the row does both. The Triton version runs one program per row, rounding as the reference's dtypes do.
"""
import torch

from nano_spec_kernels.common import FLOAT, ROW, Arg, Checker, Launch, launch, rms_normalize, tl, triton

_check = Checker("rmsnorm")
_ARGS = {"x": Arg("... D", FLOAT, ROW), "residual": Arg("... D", "x", ROW), "weight": Arg("D")}


def rmsnorm_ref(x, weight, eps: float, residual=None, multiplier: float = 1.0):
    """x (..., D), weight (D,), residual (..., D) or None -> (y, h), both (..., D)."""
    h = x if residual is None else residual + multiplier * x
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(h.dtype), h


@triton.jit
def _rmsnorm_kernel(p_x, p_res, p_w, p_y, p_h, D, eps, multiplier, stride_x, stride_r,
                    HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_x = tl.load(p_x + i_m * stride_x + o_d, mask=m_d, other=0.0)
    ty = b_x.dtype
    b_h = b_x
    if HAS_RES:
        b_r = tl.load(p_res + i_m * stride_r + o_d, mask=m_d, other=0.0)
        b_mx = (b_x.to(tl.float32) * multiplier).to(ty)  # torch rounds multiplier * x first
        b_h = (b_r.to(tl.float32) + b_mx.to(tl.float32)).to(ty)  # (BLOCK_D,) in x's dtype
        tl.store(p_h + i_m * D + o_d, b_h, mask=m_d)
    b_n = rms_normalize(b_h.to(tl.float32), D, eps, ty)
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(p_y + i_m * D + o_d, (b_w * b_n).to(p_y.dtype.element_ty), mask=m_d)


def rmsnorm_plan(x, weight, eps: float, residual=None, multiplier: float = 1.0, *, cuda: bool, n_sm: int):
    D = _check.args(_ARGS, x=x, residual=residual, weight=weight).D
    x2 = x.reshape(-1, D)
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if x2.shape[0] == 0 or D == 0:
        return [], (y, h)
    r2 = x2 if residual is None else residual.reshape(-1, D)
    BLOCK_D = triton.next_power_of_2(D)  # the row in one block
    meta = dict(HAS_RES=residual is not None, BLOCK_D=BLOCK_D, num_warps=min(16, max(1, BLOCK_D // 256)))
    return [Launch(_rmsnorm_kernel, (x2.shape[0],),
                   (x2, r2, weight, y, h, D, float(eps), float(multiplier), x2.stride(0), r2.stride(0)), meta)], (y, h)


def rmsnorm(x, weight, eps: float, residual=None, multiplier: float = 1.0):
    """Triton version of rmsnorm_ref. x and residual need a unit last-dim stride (other dims are
    flattened, copied if need be); y and a residual's h are new contiguous tensors."""
    return launch(rmsnorm_plan, x, weight, eps, residual, multiplier)


def rmsnorm_bytes(rows: int, D: int, act: int, residual: bool, param: int | None = None) -> dict:
    """The bytes one call moves, by tensor: x (and the residual) read, the weight read once, y (and h) written;
    act bytes an element of x, param of the weight (act when None), y in the wider of the two."""
    param = act if param is None else param
    return {"x": rows * D * act, "residual": rows * D * act * residual, "weight": D * param,
            "y": rows * D * max(act, param), "h": rows * D * act * residual}
