"""Mamba2 prefill: conv1d + SiLU, dt, and the SSM recurrence over the T tokens of
one prompt, starting from zero state.

Returns y (T, H, P) with the D skip, the final ssm state (H, P, N) fp32 and the
final conv window (C, W-1): the last W-1 conv inputs, zeros where T < W-1.
"""
import torch

from kernels.common import conv_silu_ref, mamba_dt_ref, split_xbc, ssm_step_ref

INF = float("inf")


def mamba_scan_ref(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, n_groups: int, head_dim: int,
                   dt_limit=(0.0, INF)):
    """xBC (T, C) conv inputs, dt (T, H) raw time steps; conv_weight (C, W), conv_bias (C,) or None,
    dt_bias, A_log, D (H,) -> (y (T, H, P) in xBC's dtype, ssm_state (H, P, N) fp32, conv_window (C, W-1))."""
    T, C = xBC.shape
    H, W = dt.shape[-1], conv_weight.shape[-1]
    window = torch.cat([xBC.new_zeros(C, W - 1), xBC.t()], dim=-1)  # (C, W-1+T)
    x, B, Cm = split_xbc(conv_silu_ref(window, conv_weight, conv_bias), H, head_dim, n_groups)
    dt = mamba_dt_ref(dt, dt_bias, dt_limit)  # (T, H)
    A = -torch.exp(A_log.float())
    state = torch.zeros(H, head_dim, B.shape[-1], dtype=torch.float32, device=xBC.device)
    ys = []
    for t in range(T):
        state, y = ssm_step_ref(state, x[t], B[t], Cm[t], dt[t], A, D)
        ys.append(y)
    return torch.stack(ys).to(xBC.dtype), state, window[:, T:].clone()
