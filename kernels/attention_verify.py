"""Attention for B sequences x K query rows, each sequence at its own length.

Row j of sequence b sits at position seq_lens[b] + j. The K new K/V rows are
appended to the slot's cache (rotated by RoPE on the way in when enabled), then
each query attends to cache positions 0 .. seq_lens[b] + j (the rows of the same
step up to its own included). K = 1 is plain decode.
"""
import torch

from kernels.common import apply_rope_ref


def attention_verify_ref(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale: float, rope_theta=None):
    """q (B, K, Hq, Dh), k, v (B, K, Hkv, Dh); k_cache, v_cache (S, L, Hkv, Dh) of one layer;
    slot_ids, seq_lens (B,). Writes cache rows seq_lens[b] .. +K-1; returns o (B, K, Hq, Dh).
    Only the first L cache rows are read, so a caller may pass a view cut to max(seq_lens) + K."""
    Bsz, K, Hq, Dh = q.shape
    Hkv, L = k.shape[2], k_cache.shape[1]
    pos = seq_lens[:, None] + torch.arange(K, device=q.device)  # (B, K)
    q = apply_rope_ref(q, pos, rope_theta)
    k = apply_rope_ref(k, pos, rope_theta)
    k_cache[slot_ids[:, None], pos] = k
    v_cache[slot_ids[:, None], pos] = v
    rep = Hq // Hkv
    kf = k_cache[slot_ids].float().repeat_interleave(rep, dim=2)  # (B, L, Hq, Dh)
    vf = v_cache[slot_ids].float().repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale  # (B, Hq, K, L)
    visible = torch.arange(L, device=q.device)[None, None, :] <= pos[:, :, None]  # (B, K, L)
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vf).to(q.dtype)
