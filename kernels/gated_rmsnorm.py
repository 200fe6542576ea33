"""The Mamba2 output norm: gate first, then RMSNorm per group, then weight.

    u = y * silu(z);  u_g = u_g / sqrt(mean(u_g^2) + eps) for each group g of size d_in/G;  out = weight * u
"""
import torch
import torch.nn.functional as F


def gated_rmsnorm_ref(y, z, weight, group_size: int, eps: float):
    """y, z (..., d_in), weight (d_in,) -> (..., d_in) in z's dtype."""
    u = y.float() * F.silu(z.float())
    *lead, d_in = u.shape
    g = u.view(*lead, d_in // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(*lead, d_in).to(z.dtype)
