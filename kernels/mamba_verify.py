"""Mamba2 multi-row verify: K rows for each of B sequences, addressed by slot.

Per sequence b (slot s = slot_ids[b]), rows j = 0..K-1:
  1. window = [conv_state[s] | xBC[b, 0..K-1]]          (C, W-1+K)  -> conv_stash[b]
  2. xbc_j = silu(conv1d(window[:, j .. j+W-1]) + bias); split into x, B, C
  3. dt_j = clamp(softplus(dt[b, j] + dt_bias), dt_limit)
  4. S = exp(dt_j A) S + dt_j x_j B_j^T -> ssm_stash[b, j];  y[b, j] = S C_j + D x_j
  5. live state: ssm_state[s] = S after row K-1, conv_state[s] = window[:, K:]
K = 1 is the plain decode step.
"""
import torch

from kernels.common import conv_silu_ref, mamba_dt_ref, split_xbc, ssm_step_ref

INF = float("inf")


def mamba_verify_ref(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D,
                     ssm_stash, conv_stash, n_groups: int, dt_limit=(0.0, INF)):
    """xBC (B, K, C), dt (B, K, H); conv_state (S, C, W-1) and ssm_state (S, H, P, N) fp32 of one layer,
    updated in place at slot_ids (B,); ssm_stash (B, K, H, P, N) fp32 and conv_stash (B, C, W-1+K) written.
    Returns y (B, K, H, P) in xBC's dtype."""
    Bsz, K, C = xBC.shape
    H, P = ssm_state.shape[1], ssm_state.shape[2]
    window = torch.cat([conv_state[slot_ids], xBC.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (B, C, W-1+K)
    conv_stash.copy_(window)
    x, B, Cm = split_xbc(conv_silu_ref(window, conv_weight, conv_bias), H, P, n_groups)  # (B, K, ...)
    dt = mamba_dt_ref(dt, dt_bias, dt_limit)  # (B, K, H)
    A = -torch.exp(A_log.float())
    state = ssm_state[slot_ids].float()  # (B, H, P, N)
    ys = []
    for j in range(K):
        state, y = ssm_step_ref(state, x[:, j], B[:, j], Cm[:, j], dt[:, j], A, D)
        ssm_stash[:, j] = state
        ys.append(y)
    ssm_state[slot_ids] = state
    conv_state[slot_ids] = window[:, :, K:]
    return torch.stack(ys, dim=1).to(xBC.dtype)
