"""RMSNorm with an optional fused residual add.

    h = residual + multiplier * x      (or h = x without a residual)
    y = weight * h / sqrt(mean(h^2) + eps)      computed in fp32

Returns (y, h): the decoder loop keeps h as the residual stream and feeds y to
the next mixer or MLP, so one pass over the row does both.
"""
import torch


def rmsnorm_ref(x, weight, eps: float, residual=None, multiplier: float = 1.0):
    """x (..., D), weight (D,), residual (..., D) or None -> (y, h), both (..., D)."""
    h = x if residual is None else residual + multiplier * x
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(h.dtype), h
