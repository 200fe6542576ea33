"""Attention for B sequences x K query rows, each sequence at its own length.

Row j of sequence b sits at position seq_lens[b] + j. The K new K/V rows are appended to the slot's cache
(RoPE-rotated when enabled), then row j attends to cache positions 0 .. seq_lens[b] + j. K = 1 is plain
decode. The kernel splits the keys of row (b, j) in two:

    old keys  n < seq_lens[b]          read from the cache, visible to every row of the step
    new keys  seq_lens[b] + j', j' <= j  the K rows of this step, rotated in registers

One program owns (sequence b, KV head h) and stacks the REP = Hq/Hkv query heads of that KV head times the K
rows into one (REP*K, Dh) query tile, so each cache block is loaded once for all of them (decode is bandwidth
bound: the cache read is the cost). The same program writes the new K/V rows to the cache and uses them from
registers, so no program ever reads a row another one is writing.

For long caches and few (b, h) pairs the old keys are split across SPLITS programs (flash decoding); each
writes its partial (m, l, acc) of the online softmax and `_combine_kernel` merges them:
o = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s. The number of splits depends only on shapes (L, B, Hkv),
never on seq_lens values, so there is no host sync; programs past a sequence's length do no work.

attention_block is the same kernel with CAUSAL=False, WRITE_KV=False, for a block drafter: Kb query rows per
sequence at positions ctx_lens[b] + j attend to the cache rows [0, ctx_lens[b]) and to all Kb rows of their own
block (no causal mask among them); the block's K/V rows are rotated in registers and never stored, so the cache
is only read. It shares the split plan and `_combine_kernel`: the block rows are split 0's, as the new rows are.
"""
import torch

from nano_spec_kernels.common import (DOT, INT, ROW, Arg, Checker, Launch, apply_rope_ref, dot_precision, launch,
                                      online_softmax_step, pow2, rope_inv_freq, rope_load, split_plan, tl, triton)

_check = Checker("attention_verify")
_ARGS = {"q": Arg("B K Hq Dh", DOT, ROW), "k, v": Arg("B K Hkv Dh", "q", ROW),
         "k_cache, v_cache": Arg("S L Hkv Dh", "q", ROW), "slot_ids, seq_lens": Arg("B", INT)}
_check_block = Checker("attention_block")
_BLOCK_ARGS = {"q": Arg("B Kb Hq Dh", DOT, ROW), "k, v": Arg("B Kb Hkv Dh", "q", ROW),
               "k_cache, v_cache": Arg("S L Hkv Dh", "q", ROW), "slot_ids, ctx_lens": Arg("B", INT)}


def _attend_ref(q, keys, vals, visible, scale: float):
    """Softmax attention in fp32 of q (B, K, Hq, Dh) over keys, vals (B, N, Hkv, Dh) where visible, a mask that
    broadcasts to the scores (B, Hq, K, N); o (B, K, Hq, Dh) in q's dtype."""
    rep = q.shape[2] // keys.shape[2]  # query heads per KV head
    kf, vf = (t.float().repeat_interleave(rep, dim=2) for t in (keys, vals))  # (B, N, Hq, Dh)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale  # (B, Hq, K, N)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vf).to(q.dtype)


def attention_verify_ref(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale: float, rope_theta=None):
    """q (B, K, Hq, Dh), k, v (B, K, Hkv, Dh); k_cache, v_cache (S, L, Hkv, Dh) of one layer;
    slot_ids, seq_lens (B,). Writes cache rows seq_lens[b] .. +K-1; returns o (B, K, Hq, Dh).
    Only the first L cache rows are read, so a caller may pass a view cut to max(seq_lens) + K."""
    K, L = q.shape[1], k_cache.shape[1]
    pos = seq_lens[:, None] + torch.arange(K, device=q.device)  # (B, K)
    k_cache[slot_ids[:, None], pos] = apply_rope_ref(k, pos, rope_theta)  # k is cached rotated
    v_cache[slot_ids[:, None], pos] = v
    visible = torch.arange(L, device=q.device)[None, None, :] <= pos[:, :, None]  # (B, K, L)
    return _attend_ref(apply_rope_ref(q, pos, rope_theta), k_cache[slot_ids], v_cache[slot_ids], visible[:, None],
                       scale)


def attention_block_ref(q, k, v, k_cache, v_cache, slot_ids, ctx_lens, scale: float, rope_theta=None):
    """q (B, Kb, Hq, Dh), k, v (B, Kb, Hkv, Dh) at positions ctx_lens[b] + j, rotated here; k_cache, v_cache
    (S, L, Hkv, Dh) of one layer, already rotated, only read. Returns o (B, Kb, Hq, Dh)."""
    Kb, L = q.shape[1], k_cache.shape[1]
    pos = ctx_lens[:, None] + torch.arange(Kb, device=q.device)  # (B, Kb)
    keys = torch.cat((k_cache[slot_ids], apply_rope_ref(k, pos, rope_theta)), 1)  # (B, L + Kb, Hkv, Dh)
    vals = torch.cat((v_cache[slot_ids], v), 1)
    n = torch.arange(L + Kb, device=q.device)
    visible = (n[None, :] < ctx_lens[:, None]) | (n[None, :] >= L)  # (B, L + Kb): the context, then the block
    return _attend_ref(apply_rope_ref(q, pos, rope_theta), keys, vals, visible[:, None, None], scale)


@triton.jit
def _verify_attention_kernel(
    p_q, p_k, p_v, p_kc, p_vc, p_slot, p_len, p_o, p_mpart, p_lpart, p_opart, p_inv_freq,
    L, CHUNK, scale,
    s_q_b, s_q_k, s_q_h, s_k_b, s_k_k, s_k_h, s_v_b, s_v_k, s_v_h,
    s_kc_s, s_kc_t, s_kc_h, s_vc_s, s_vc_t, s_vc_h, s_o_b, s_o_k, s_o_h,
    K: tl.constexpr, HKV: tl.constexpr, REP: tl.constexpr, DH: tl.constexpr, DH_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr,
    SPLITS: tl.constexpr, ROPE: tl.constexpr, DOT_PREC: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_KV: tl.constexpr,
):
    """grid (B * Hkv, SPLITS). CAUSAL: row j sees new rows j' <= j (verify), else all K (block);
    WRITE_KV: the new K/V rows are appended to the cache (verify), else only used from registers (block)."""
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_hkv = i_bh // HKV, i_bh % HKV
    slot = tl.load(p_slot + i_b).to(tl.int64)
    seq_len = tl.load(p_len + i_b).to(tl.int32)

    # query tile rows r = g * K + j: query head i_hkv * REP + g, step row j
    o_r = tl.arange(0, BLOCK_M)
    o_hq, o_jq = i_hkv * REP + o_r // K, o_r % K
    m_r = o_r < REP * K
    o_d = tl.arange(0, DH_PAD)
    m_d = o_d < DH
    o_q = i_b * s_q_b + o_jq * s_q_k + o_hq * s_q_h  # rows of the query tile b_q (BLOCK_M, DH_PAD)
    b_q = rope_load(p_q, p_inv_freq, o_q, m_r, seq_len + o_jq, o_d, DH, ROPE).to(p_q.dtype.element_ty)

    b_m = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite start: an empty split stays NaN-free
    b_l = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, DH_PAD], tl.float32)

    # old keys of this split: cache rows [lo, hi), all visible to every query row
    p_kc_head = p_kc + slot * s_kc_s + i_hkv * s_kc_h
    p_vc_head = p_vc + slot * s_vc_s + i_hkv * s_vc_h
    lo = i_s * CHUNK
    hi = tl.minimum(lo + CHUNK, seq_len)
    o_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        o_kn = start_n + o_n
        m_kn = o_kn < hi
        m_kv = m_kn[:, None] & m_d[None, :]
        b_k = tl.load(p_kc_head + o_kn[:, None] * s_kc_t + o_d[None, :], mask=m_kv, other=0.0)  # (BLOCK_N, DH_PAD)
        b_v = tl.load(p_vc_head + o_kn[:, None] * s_vc_t + o_d[None, :], mask=m_kv, other=0.0)
        b_m, b_l, b_acc = online_softmax_step(b_q, b_k, b_v, m_kn[None, :], scale, b_m, b_l, b_acc, DOT_PREC)

    # new keys: split 0 rotates the K new rows, appends them to the cache (WRITE_KV) and attends to them,
    # causally (CAUSAL) or all of them
    if i_s == 0:
        o_j = tl.arange(0, K_PAD)
        m_j = o_j < K
        m_jd = m_j[:, None] & m_d[None, :]
        o_pos = seq_len + o_j
        b_kn = rope_load(p_k + i_b * s_k_b + i_hkv * s_k_h, p_inv_freq, o_j * s_k_k, m_j, o_pos, o_d, DH, ROPE)
        b_kn = b_kn.to(p_kc.dtype.element_ty)  # (K_PAD, DH_PAD), rounded as the cache stores it
        b_vn = tl.load(p_v + i_b * s_v_b + i_hkv * s_v_h + o_j[:, None] * s_v_k + o_d[None, :], mask=m_jd, other=0.0)
        b_vn = b_vn.to(p_vc.dtype.element_ty)
        if WRITE_KV:
            # rows past the cache end cannot be stored (the caller guarantees seq_lens + K <= L)
            m_st = m_jd & (o_pos < L)[:, None]
            tl.store(p_kc_head + o_pos[:, None] * s_kc_t + o_d[None, :], b_kn, mask=m_st)
            tl.store(p_vc_head + o_pos[:, None] * s_vc_t + o_d[None, :], b_vn, mask=m_st)
        m_new = m_j[None, :]  # (1, K_PAD): padding rows of the block are never keys
        if CAUSAL:
            m_new = m_new & (o_j[None, :] <= o_jq[:, None])  # (BLOCK_M, K_PAD)
        b_m, b_l, b_acc = online_softmax_step(b_q, b_kn, b_vn, m_new, scale, b_m, b_l, b_acc, DOT_PREC)

    m_out = m_r[:, None] & m_d[None, :]
    if SPLITS == 1:
        b_o = b_acc / b_l[:, None]
        p_o_blk = p_o + i_b * s_o_b + o_jq[:, None] * s_o_k + o_hq[:, None] * s_o_h + o_d[None, :]
        tl.store(p_o_blk, b_o.to(p_o.dtype.element_ty), mask=m_out)
    else:
        # partials (B, K, Hq, SPLITS[, DH_PAD]) fp32, merged by _combine_kernel
        o_part = ((i_b * K + o_jq) * (HKV * REP) + o_hq) * SPLITS + i_s  # (BLOCK_M,)
        tl.store(p_mpart + o_part, b_m, mask=m_r)
        tl.store(p_lpart + o_part, b_l, mask=m_r)
        tl.store(p_opart + o_part[:, None] * DH_PAD + o_d[None, :], b_acc, mask=m_out)


@triton.jit
def _combine_kernel(
    p_mpart, p_lpart, p_opart, p_o, s_o_b, s_o_k, s_o_h,
    K: tl.constexpr, HQ: tl.constexpr, DH: tl.constexpr, DH_PAD: tl.constexpr,
    SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """grid (B * K * Hq,): merge the SPLITS partial softmaxes of one query row."""
    i_row = tl.program_id(0)  # = (b * K + j) * Hq + h
    i_b, i_j, i_h = i_row // (K * HQ), (i_row // HQ) % K, i_row % HQ
    o_s = tl.arange(0, SPLITS_PAD)
    o_d = tl.arange(0, DH_PAD)
    m_s = o_s < SPLITS
    b_m = tl.load(p_mpart + i_row * SPLITS + o_s, mask=m_s, other=-1.0e30)  # (SPLITS_PAD,)
    b_l = tl.load(p_lpart + i_row * SPLITS + o_s, mask=m_s, other=0.0)
    # lanes d >= DH were never written (torch.empty): mask them rather than multiply garbage
    m_sd = m_s[:, None] & (o_d < DH)[None, :]
    b_acc = tl.load(p_opart + (i_row * SPLITS + o_s)[:, None] * DH_PAD + o_d[None, :], mask=m_sd, other=0.0)
    b_w = tl.exp(b_m - tl.max(b_m, 0))  # empty splits carry m = -1e30, so their weight is 0
    b_o = tl.sum(b_w[:, None] * b_acc, 0) / tl.sum(b_w * b_l, 0)  # (DH_PAD,)
    tl.store(p_o + i_b * s_o_b + i_j * s_o_k + i_h * s_o_h + o_d, b_o.to(p_o.dtype.element_ty), mask=o_d < DH)


def verify_meta(Hq: int, Hkv: int, Dh: int, K: int, dtype: torch.dtype, cuda: bool) -> dict:
    """_verify_attention_kernel's meta-parameters (scripts/compile_check.py compiles these). The query tile stacks
    the REP*K rows of one KV head (at least 16, tl.dot's least side). The key blocks, on sm_90:

      bf16/fp16: BLOCK_N x DH_PAD <= 64 x 64 elements, 4 warps, 3 stages. At Dh = 128 a 64-key block takes 128+
        registers and 72 KB for its three staged K/V tiles, 12 resident warps per SM; 32 keys keep 120 registers,
        38 KB and 16 warps (a decode kernel's floor, compile_check.MIN_WARPS). A tall query tile (BLOCK_M x DH_PAD
        >= 64 x 128, e.g. attention_block's 3 heads x 16 rows at Dh = 128) takes 8 warps: with 4, its tiles need
        65 KB and only 12 warps stay resident; with 8, 105 registers and 2 blocks of 8 warps.
      fp32 ("ieee" tl.dot, on the FMA units): 32-key blocks, the interpreter's (so CUDA fp32 blocks the sum as the
        tests do), 8 warps, 2 stages; 4 warps spill at Dh = 128."""
    DH_PAD, BLOCK_M = pow2(Dh), pow2((Hq // Hkv) * K)
    block_n, warps, stages = 32, 8, 2  # fp32, and the interpreter
    if cuda and dtype != torch.float32:
        block_n, warps, stages = min(64, max(16, 4096 // DH_PAD)), 4 if BLOCK_M * DH_PAD < 64 * 128 else 8, 3
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, DH_PAD=DH_PAD, K_PAD=pow2(K),
                DOT_PREC=dot_precision(dtype), num_warps=warps, num_stages=stages)


def attention_verify_plan(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale, rope_theta=None, num_splits=None, *,
                          cuda: bool, n_sm: int):
    _check.args(_ARGS, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_ids=slot_ids, seq_lens=seq_lens)
    return _plan(_check, q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale, rope_theta, num_splits, cuda, n_sm,
                 verify=True)


def attention_block_plan(q, k, v, k_cache, v_cache, slot_ids, ctx_lens, scale, rope_theta=None, num_splits=None, *,
                         cuda: bool, n_sm: int):
    _check_block.args(_BLOCK_ARGS, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_ids=slot_ids,
                      ctx_lens=ctx_lens)
    return _plan(_check_block, q, k, v, k_cache, v_cache, slot_ids, ctx_lens, scale, rope_theta, num_splits, cuda,
                 n_sm, verify=False)


def _plan(check, q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale, rope_theta, num_splits, cuda, n_sm, *,
          verify: bool):
    """The launches of either variant, its tensors already checked by `check` (which names the variant); num_splits:
    the split count, else split_plan's (tests force the split and unsplit paths)."""
    (Bsz, K, Hq, Dh), Hkv, L = q.shape, k.shape[2], k_cache.shape[1]
    check(Hkv > 0 and Hq % Hkv == 0, f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    check(rope_theta is None or Dh % 2 == 0, f"RoPE needs an even head dim, got {Dh}")
    if verify:
        check(1 <= K <= L, f"K={K} rows must be in [1, L={L}]")
    else:  # nothing is stored, so L does not bound the block
        check(K >= 1, f"Kb={K} block rows must be at least 1")
    o = torch.empty((Bsz, K, Hq, Dh), dtype=q.dtype, device=q.device)
    if Bsz == 0:
        return [], o

    meta = verify_meta(Hq, Hkv, Dh, K, q.dtype, cuda)
    chunk, splits = split_plan(L, meta["BLOCK_N"], Bsz * Hkv, n_sm, num_splits)  # keys per split
    mpart = lpart = opart = o  # unused when there is one split
    if splits > 1:
        mpart, lpart = (torch.empty((Bsz, K, Hq, splits), dtype=torch.float32, device=q.device) for _ in range(2))
        opart = torch.empty((Bsz, K, Hq, splits, meta["DH_PAD"]), dtype=torch.float32, device=q.device)
    inv_freq = rope_inv_freq(Dh, rope_theta, q.device)
    launches = [Launch(_verify_attention_kernel, (Bsz * Hkv, splits), (
        q, k, v, k_cache, v_cache, slot_ids, seq_lens, o, mpart, lpart, opart, inv_freq,
        L, chunk, float(scale),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3], *o.stride()[:3],
    ), dict(K=K, HKV=Hkv, REP=Hq // Hkv, DH=Dh, SPLITS=splits, ROPE=rope_theta is not None, CAUSAL=verify,
            WRITE_KV=verify, **meta))]
    if splits > 1:
        launches.append(Launch(_combine_kernel, (Bsz * K * Hq,), (mpart, lpart, opart, o, *o.stride()[:3]), dict(
            K=K, HQ=Hq, DH=Dh, DH_PAD=meta["DH_PAD"], SPLITS=splits, SPLITS_PAD=pow2(splits, 1), num_warps=4)))
    return launches, o


def attention_verify(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale: float, rope_theta=None):
    """Triton version of attention_verify_ref (same signature, same cache writes, same output).
    The caller guarantees seq_lens[b] + K <= L (checked by the reference's indexing, not here: that
    would need a host sync); new rows past L are not stored."""
    return launch(attention_verify_plan, q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale, rope_theta)


def attention_block(q, k, v, k_cache, v_cache, slot_ids, ctx_lens, scale: float, rope_theta=None):
    """Triton version of attention_block_ref (same signature, same output; the caches are only read).
    The caller guarantees ctx_lens[b] <= L (a check would need a host sync)."""
    return launch(attention_block_plan, q, k, v, k_cache, v_cache, slot_ids, ctx_lens, scale, rope_theta)


def attention_verify_bytes(B: int, K: int, Hq: int, Hkv: int, Dh: int, ctx: int, act: int, splits: int = 1,
                           rope: bool = False) -> dict:
    """The bytes one call moves, by tensor: what each launch loads or stores, every element once per launch (each
    K/V cache row is read once for all REP*K query rows of its KV head). ctx: the cache rows each sequence
    already holds (seq_lens); act: bytes of an element of q and of the cache; ids int64, partials fp32."""
    out = {
        "q": B * K * Hq * Dh * act, "k, v": 2 * B * K * Hkv * Dh * act, "cache rows read": 2 * B * ctx * Hkv * Dh * act,
        "slot_ids, seq_lens": 2 * B * 8, "inv_freq": Dh // 2 * 4 if rope else 0,
        "cache rows written": 2 * B * K * Hkv * Dh * act, "o": B * K * Hq * Dh * act,
    }
    if splits > 1:  # (m, l, acc) of every split, written by the splits and read by _combine_kernel
        out["partials written"] = out["partials read"] = B * K * Hq * splits * (2 + pow2(Dh)) * 4
    return out
