"""Commit the Mamba state to the accepted prefix, all layers and sequences at once.

After a verify over K rows every Mamba layer's live state is the state after
row K-1. When a sequence accepted na < K-1 drafts, its state must be the one
after row na instead:

    ssm_state[l, s]  <- ssm_stash[l, b, na]                  (H, P, N)
    conv_state[l, s] <- conv_stash[l, b, :, na+1 : na+W]     (C, W-1): the last W-1 inputs up to row na

Full accepts (na = K-1) and inactive rows are left untouched.
"""
import torch


def commit_state_ref(ssm_state, conv_state, ssm_stash, conv_stash, slot_ids, na, active):
    """ssm_state (L, S, H, P, N), conv_state (L, S, C, W-1), ssm_stash (L, B, K, H, P, N),
    conv_stash (L, B, C, W-1+K), slot_ids, na (B,) int, active (B,) bool. In place; no host sync."""
    K = ssm_stash.shape[2]
    Wm1 = conv_state.shape[-1]
    rows = torch.arange(slot_ids.shape[0], device=na.device)
    take = (active & (na < K - 1))  # (B,)
    na_c = na.clamp(0, K - 1)
    new_ssm = ssm_stash[:, rows, na_c]  # (L, B, H, P, N)
    cols = (na_c[:, None] + 1 + torch.arange(Wm1, device=na.device))  # (B, W-1)
    idx = cols[None, :, None, :].expand(conv_stash.shape[0], -1, conv_stash.shape[2], -1)
    new_conv = conv_stash.gather(-1, idx)  # (L, B, C, W-1)
    ssm_state[:, slot_ids] = torch.where(take[None, :, None, None, None], new_ssm, ssm_state[:, slot_ids])
    conv_state[:, slot_ids] = torch.where(take[None, :, None, None], new_conv, conv_state[:, slot_ids])
