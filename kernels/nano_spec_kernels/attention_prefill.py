"""Causal attention over one prompt, writing the prompt's K/V into its cache slot.

    q (T, Hq, Dh), k, v (T, Hkv, Dh) at positions 0..T-1; query head i reads KV head i // (Hq/Hkv);
    scores = scale * q k^T (scale is the checkpoint's attention_multiplier), causal; RoPE on q and k
    when rope_theta is set (k is cached rotated; the formula is at kernels.common.apply_rope_ref).

Flash attention (online softmax): a block of query rows walks the key blocks left to right keeping,
per row, the running max m, the running denominator l and the unnormalised output acc:

    m' = max(m, max_n s_n);   l' = l e^(m - m') + sum_n e^(s_n - m');   acc' = acc e^(m - m') + e^(s - m') V

and o = acc / l at the end. Causality stops the walk at the block holding the row's own position.

Two launches: `_rope_store_kernel` rotates k and writes k, v into the slot's rows 0..T-1; then
`_prefill_attention_kernel` reads K/V back from the cache (so the attention sees exactly the cached,
rounded values, as the reference does) and rotates q on load.
"""
import torch

from nano_spec_kernels.common import (DOT, ROW, Arg, Checker, Launch, apply_rope_ref, dot_precision, launch,
                                      online_softmax_step, pow2, rope_inv_freq, rope_load, tl, triton)

_check = Checker("attention_prefill")
_ARGS = {"q": Arg("T Hq Dh", DOT, ROW), "k, v": Arg("T Hkv Dh", "q", ROW),
         "k_cache, v_cache": Arg("S L Hkv Dh", "q", ROW)}


def attention_prefill_ref(q, k, v, k_cache, v_cache, slot: int, scale: float, rope_theta=None):
    """q (T, Hq, Dh), k, v (T, Hkv, Dh); k_cache, v_cache (S, L, Hkv, Dh) of one layer.
    Writes rows 0..T-1 of the slot; returns o (T, Hq, Dh) in q's dtype."""
    T, rep = q.shape[0], q.shape[1] // k.shape[1]  # rep query heads per KV head
    pos = torch.arange(T, device=q.device)
    q = apply_rope_ref(q, pos, rope_theta)
    k_cache[slot, :T] = apply_rope_ref(k, pos, rope_theta)  # k is cached rotated
    v_cache[slot, :T] = v
    kf, vf = (c[slot, :T].float().repeat_interleave(rep, dim=1) for c in (k_cache, v_cache))  # (T, Hq, Dh)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # (Hq, T, T)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vf).to(q.dtype)


@triton.jit
def _rope_store_kernel(
    p_k, p_v, p_kc, p_vc, p_inv_freq,
    T, slot,
    s_k_t, s_k_h, s_v_t, s_v_h,
    s_kc_s, s_kc_t, s_kc_h, s_vc_s, s_vc_t, s_vc_h,
    DH: tl.constexpr, DH_PAD: tl.constexpr, BLOCK_T: tl.constexpr, ROPE: tl.constexpr,
):
    """grid (cdiv(T, BLOCK_T), Hkv): k_cache[slot, t, h] = rope(k[t, h], t); v_cache[slot, t, h] = v[t, h]."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, DH_PAD)
    m_t = o_t < T
    m_x = m_t[:, None] & (o_d < DH)[None, :]
    b_k = rope_load(p_k + i_h * s_k_h, p_inv_freq, o_t * s_k_t, m_t, o_t, o_d, DH, ROPE)  # (BLOCK_T, DH_PAD)
    b_v = tl.load(p_v + i_h * s_v_h + o_t[:, None] * s_v_t + o_d[None, :], mask=m_x, other=0.0)
    p_kc_blk = p_kc + slot * s_kc_s + i_h * s_kc_h + o_t[:, None] * s_kc_t + o_d[None, :]
    p_vc_blk = p_vc + slot * s_vc_s + i_h * s_vc_h + o_t[:, None] * s_vc_t + o_d[None, :]
    tl.store(p_kc_blk, b_k.to(p_kc.dtype.element_ty), mask=m_x)
    tl.store(p_vc_blk, b_v.to(p_vc.dtype.element_ty), mask=m_x)


@triton.jit
def _prefill_attention_kernel(
    p_q, p_kc, p_vc, p_o, p_inv_freq,
    T, slot, scale,
    s_q_t, s_q_h, s_kc_s, s_kc_t, s_kc_h, s_vc_s, s_vc_t, s_vc_h, s_o_t, s_o_h,
    REP: tl.constexpr, DH: tl.constexpr, DH_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """grid (cdiv(T, BLOCK_M), Hq): one block of query rows of one head over the cached keys 0..row."""
    i_m, i_hq = tl.program_id(0), tl.program_id(1)
    i_hkv = i_hq // REP  # GQA: REP query heads share one KV head
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, DH_PAD)
    m_m = o_m < T
    m_d = o_d < DH

    # q (BLOCK_M, DH_PAD) is rotated in fp32 then rounded to its dtype, as the reference does before the matmul
    b_q = rope_load(p_q + i_hq * s_q_h, p_inv_freq, o_m * s_q_t, m_m, o_m, o_d, DH, ROPE).to(p_q.dtype.element_ty)

    p_k_head = p_kc + slot * s_kc_s + i_hkv * s_kc_h
    p_v_head = p_vc + slot * s_vc_s + i_hkv * s_vc_h
    b_m = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite start: a fully masked block gives alpha = 1, not NaN
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, DH_PAD], tl.float32)
    # causal: keys beyond the last row of this query block are never visible
    hi = tl.minimum((i_m + 1) * BLOCK_M, T)
    for start_n in range(0, hi, BLOCK_N):
        o_kn = start_n + o_n
        m_kn = o_kn < T
        m_kv = m_kn[:, None] & m_d[None, :]
        b_k = tl.load(p_k_head + o_kn[:, None] * s_kc_t + o_d[None, :], mask=m_kv, other=0.0)  # (BLOCK_N, DH_PAD)
        b_v = tl.load(p_v_head + o_kn[:, None] * s_vc_t + o_d[None, :], mask=m_kv, other=0.0)
        m_s = (o_kn[None, :] <= o_m[:, None]) & m_kn[None, :]  # causal
        b_m, b_l, b_acc = online_softmax_step(b_q, b_k, b_v, m_s, scale, b_m, b_l, b_acc, DOT_PREC)

    b_o = b_acc / b_l[:, None]
    p_o_blk = p_o + o_m[:, None] * s_o_t + i_hq * s_o_h + o_d[None, :]
    tl.store(p_o_blk, b_o.to(p_o.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


def prefill_meta(Dh: int, dtype: torch.dtype, cuda: bool) -> dict:
    """_prefill_attention_kernel's meta-parameters (scripts/compile_check.py compiles these), on sm_90:
    bf16/fp16: 64 x 64 blocks, 4 warps, 3 stages (no spill up to Dh = 128); fp32 ("ieee" tl.dot, on the FMA
    units): 32 x 32 blocks, the interpreter's, 8 warps, 2 stages, since 64 x 64 spills kilobytes at any warp count."""
    block, warps, stages = (64, 4, 3) if cuda and dtype != torch.float32 else (32, 8, 2)
    return dict(DH_PAD=pow2(Dh), BLOCK_M=block, BLOCK_N=block, DOT_PREC=dot_precision(dtype), num_warps=warps,
                num_stages=stages)


def attention_prefill_plan(q, k, v, k_cache, v_cache, slot: int, scale: float, rope_theta=None, *, cuda: bool,
                           n_sm: int):
    d = _check.args(_ARGS, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    T, Hq, Hkv, Dh, S, L = d.T, d.Hq, d.Hkv, d.Dh, d.S, d.L
    _check(Hkv > 0 and Hq % Hkv == 0, f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    _check(rope_theta is None or Dh % 2 == 0, f"RoPE needs an even head dim, got {Dh}")
    _check(0 <= int(slot) < S, f"slot {slot} out of range [0, {S})")
    _check(T <= L, f"prompt of {T} tokens does not fit a cache of {L} rows")
    if T == 0:
        return [], torch.empty_like(q)

    rope = rope_theta is not None
    inv_freq = rope_inv_freq(Dh, rope_theta, q.device)
    store = dict(DH_PAD=pow2(Dh), BLOCK_T=32, num_warps=4)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    meta = prefill_meta(Dh, q.dtype, cuda)
    return [
        Launch(_rope_store_kernel, (triton.cdiv(T, store["BLOCK_T"]), Hkv), (
            k, v, k_cache, v_cache, inv_freq, T, int(slot),
            *k.stride()[:2], *v.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3],
        ), dict(DH=Dh, ROPE=rope, **store)),
        Launch(_prefill_attention_kernel, (triton.cdiv(T, meta["BLOCK_M"]), Hq), (
            q, k_cache, v_cache, o, inv_freq, T, int(slot), float(scale),
            *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *o.stride()[:2],
        ), dict(REP=Hq // Hkv, DH=Dh, ROPE=rope, **meta)),
    ], o


def attention_prefill(q, k, v, k_cache, v_cache, slot: int, scale: float, rope_theta=None):
    """Triton version of attention_prefill_ref (same signature, same cache writes, same output)."""
    return launch(attention_prefill_plan, q, k, v, k_cache, v_cache, slot, scale, rope_theta)


def attention_prefill_bytes(T: int, Hq: int, Hkv: int, Dh: int, act: int, rope: bool = False) -> dict:
    """The bytes one call moves, by tensor: what each of its two launches loads or stores, every element once per
    launch (a cached K/V row is read once for all the query blocks and the REP query heads that see it; the rereads
    come from L2). act: bytes of an element of q, k, v and the cache; inv_freq fp32, loaded by both launches."""
    return {"q": T * Hq * Dh * act, "k, v": 2 * T * Hkv * Dh * act, "inv_freq": 2 * (Dh // 2) * 4 if rope else 0,
            "cache rows written": 2 * T * Hkv * Dh * act, "cache rows read": 2 * T * Hkv * Dh * act,
            "o": T * Hq * Dh * act}
