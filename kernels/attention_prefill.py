"""Causal attention over one prompt, writing the prompt's K/V into its cache slot.

    q (T, Hq, Dh), k, v (T, Hkv, Dh) at positions 0..T-1; query head i reads KV head i // (Hq/Hkv);
    scores = scale * q k^T (scale is the checkpoint's attention_multiplier), causal; RoPE on q and k
    when rope_theta is set (k is cached rotated).
"""
import torch

from kernels.common import apply_rope_ref


def attention_prefill_ref(q, k, v, k_cache, v_cache, slot: int, scale: float, rope_theta=None):
    """q (T, Hq, Dh), k, v (T, Hkv, Dh); k_cache, v_cache (S, L, Hkv, Dh) of one layer.
    Writes rows 0..T-1 of the slot; returns o (T, Hq, Dh) in q's dtype."""
    T, Hq, Dh = q.shape
    Hkv = k.shape[1]
    pos = torch.arange(T, device=q.device)
    q = apply_rope_ref(q, pos, rope_theta)
    k = apply_rope_ref(k, pos, rope_theta)
    k_cache[slot, :T] = k
    v_cache[slot, :T] = v
    rep = Hq // Hkv
    kf = k_cache[slot, :T].float().repeat_interleave(rep, dim=1)  # (T, Hq, Dh)
    vf = v_cache[slot, :T].float().repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # (Hq, T, T)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vf).to(q.dtype)
