"""Sampled verdict: the lossless rejection rule (docs/DESIGN.md §5).

Per sequence with target probabilities p_j (temperature, top-k, top-p applied to
the logits of row j) and the draft probabilities q_j the drafts were sampled from:
  - draft j < nd is accepted when u[j] * q_j(d_j) < p_j(d_j)  (probability min(1, p/q));
  - na = the number of leading accepts;
  - the emitted token v ~ normalize(max(0, p_na - q_na)) after a rejection, or
    v ~ p_nd after a full accept, drawn by inverse CDF with u[K-1].

Kernel split: top-k / top-p need a sort over V, so the launcher builds the filtered
target probabilities p (B, K, V) with `sampling_probs_ref` in torch (the same code the
draft side uses, so p is bit-identical to the reference's); the sort, ~50x the softmax,
runs only when some row filters (`filtered`, known on the host). `_verdict_sample_kernel`
(BLOCK_B sequences per program) then does the rest with gathers and tiled passes over V:

  0. the acceptance tests: K-1 loads of p and q at the drafts give na;
  1. (after a rejection) whether the residual r = max(0, p_na - q_na) has any mass;
  2. the total of the chosen weights w (r or p_na) as a running prefix sum;
  3. the inverse-CDF draw: token = #{v : cdf[v] <= u[K-1] * cdf[V-1]}, counted block by block.

Exactness. The acceptance tests read the same fp32 values as the reference and do the same single multiply, so
na is bit-exact; "residual sum > 0" does not depend on summation order (all terms are >= 0). Only the
cumulative sums are rounded differently (torch's sequential scan vs per-block tree scans here), by a few ulp
of the total, so the token can differ only when u * total falls within that distance of one of the V cdf
values: a probability ~1e-6 per draw for fp32, i.e. never for fixed test uniforms away from the cdf steps. The
total is the last element of the kernel's own scan (not a separate sum), so the search and the threshold are
consistent and a draw never runs past the last token with mass except where the reference would too.
"""
import torch

from nano_spec_kernels.common import FLOAT, INT, ROW, STRIDED, Arg, Checker, Launch, launch, one_of, tl, triton

_check = Checker("verdict_sample")
_ARGS = {  # logits and uniforms go through torch, drafts by strides; the kernel reads nd[b] at b
    "logits": Arg("B K V", FLOAT, STRIDED), "draft_probs": Arg("B K-1 V", FLOAT, ROW),
    "drafts": Arg("B K-1", INT, STRIDED), "nd": Arg("B", INT),
    "uniforms": Arg("B K", one_of(torch.float32, torch.float64), STRIDED),
    "temperature, top_k, top_p": Arg("B", layout=STRIDED),
}


def sampling_probs_ref(logits, temperature, top_k, top_p, filtered: bool = True):
    """logits (B, R, V); temperature (B,) > 0, top_k (B,) int (0 = off), top_p (B,) in (0, 1] (1 = off) ->
    probs (B, R, V) fp32. top-k keeps the k largest; top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p (at least one token). Applied to draft and target alike.
    filtered: whether any row has top-k or top-p on (the host knows); False skips the sort. A row with
    neither gets the plain softmax either way, so its probabilities do not depend on its batch."""
    # Shift by the row max before scaling: (x - max) / T <= 0 cannot overflow however small T is. T is
    # floored at fp32's smallest normal, since a tiny T (1e-300) rounds to 0 in fp32.
    lf = logits.float()
    t = temperature.float().clamp(min=torch.finfo(torch.float32).tiny)[:, None, None]
    lf = (lf - lf.amax(-1, keepdim=True)) / t
    p = lf.softmax(-1)  # (B, R, V) what a row without filters draws from
    if not filtered:
        return p
    V = lf.shape[-1]
    sorted_l, order = lf.sort(-1, descending=True)
    k = torch.where(top_k > 0, top_k, V)[:, None, None]
    keep = torch.arange(V, device=lf.device) < k  # (B, R, V) in sorted order
    sorted_l = sorted_l.masked_fill(~keep, float("-inf"))
    sp = sorted_l.softmax(-1)
    keep = keep & (sp.cumsum(-1) - sp < top_p[:, None, None])  # the mass before each token
    keep[..., 0].fill_(True)  # the most likely token always (fill_: no host scalar to upload)
    sp = sp.masked_fill(~keep, 0.0)
    sp = sp / sp.sum(-1, keepdim=True)
    on = ((top_k > 0) | (top_p < 1))[:, None, None]  # (B, 1, 1) the rows that filter
    return torch.where(on, torch.zeros_like(sp).scatter(-1, order, sp), p)


def verdict_sample_ref(logits, draft_probs, drafts, nd, uniforms, temperature, top_k, top_p, filtered=True):
    """logits (B, K, V); draft_probs (B, K-1, V); drafts (B, K-1) int64; nd (B,) int64;
    uniforms (B, K) in [0, 1); temperature, top_k, top_p (B,); filtered as sampling_probs_ref's
    -> (na (B,) int64, token (B,) int64)."""
    Bsz, K, V = logits.shape
    p = sampling_probs_ref(logits, temperature, top_k, top_p, filtered)  # (B, K, V)
    rows = torch.arange(Bsz, device=logits.device)
    if K > 1:
        p_d = p[:, : K - 1].gather(-1, drafts[..., None])[..., 0]  # (B, K-1)
        q_d = draft_probs.float().gather(-1, drafts[..., None])[..., 0]
        ok = (uniforms[:, : K - 1] * q_d < p_d) & (torch.arange(K - 1, device=logits.device) < nd[:, None])
        na = ok.long().cumprod(-1).sum(-1)
    else:
        na = torch.zeros(Bsz, dtype=torch.long, device=logits.device)
    target = p[rows, na]  # (B, V)
    if K > 1:  # after a rejection the token is drawn from the residual max(0, p - q)
        q_na = draft_probs.float()[rows, na.clamp(max=K - 2)]
        resid = (target - q_na).clamp(min=0)
        # p == q exactly makes a rejection impossible; fall back to p if rounding produced one
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, target)
        target = torch.where((na < nd)[:, None], resid, target)
    cdf = target.cumsum(-1)
    thresh = uniforms[:, K - 1 : K] * cdf[:, -1:]
    token = (cdf <= thresh).sum(-1).clamp(max=V - 1)
    return na, token


@triton.jit
def _chosen_weights(p_p, p_q, o_t, o_q, o_x, m_b, V, b_resid, K: tl.constexpr):
    """The weights the token is drawn from (max(0, p - q) after a rejection, else p) and the mask of the V block o_x."""
    m_x = m_b[:, None] & (o_x < V)[None, :]
    b_w = tl.load(p_p + o_t[:, None] + o_x[None, :], mask=m_x, other=0.0)
    if K > 1:
        b_qv = tl.load(p_q + o_q[:, None] + o_x[None, :], mask=m_x & b_resid[:, None], other=0.0).to(tl.float32)
        b_w = tl.where(b_resid[:, None], tl.maximum(b_w - b_qv, 0.0), b_w)
    return b_w, m_x


@triton.jit
def _verdict_sample_kernel(
    p_p, p_q, p_drafts, p_nd, p_u, p_na, p_tok, B, V,
    s_q_b, s_q_k, s_d_b, s_d_k, s_u_b, s_u_k,
    K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """grid (cdiv(B, BLOCK_B),): BLOCK_B sequences per program (1 for a large V, more for a small one).
    p (B, K, V) fp32 contiguous; q (B, K-1, V); drafts (B, K-1); uniforms (B, K)."""
    o_b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    m_b = o_b < B
    b_nd = tl.load(p_nd + o_b, mask=m_b, other=0).to(tl.int64)  # (BLOCK_B,)
    o_prow = o_b.to(tl.int64) * K * V  # offset of p[b, 0]

    # 0. acceptance: draft j passes when u_j * q_j(d_j) < p_j(d_j); na counts the leading passes
    b_alive = m_b
    b_na = tl.zeros([BLOCK_B], tl.int64)
    for j in tl.static_range(K - 1):
        b_d = tl.load(p_drafts + o_b * s_d_b + j * s_d_k, mask=m_b, other=0)
        b_pd = tl.load(p_p + o_prow + j * V + b_d, mask=m_b, other=0.0)
        b_qd = tl.load(p_q + o_b * s_q_b + j * s_q_k + b_d, mask=m_b, other=0.0).to(tl.float32)
        b_u = tl.load(p_u + o_b * s_u_b + j * s_u_k, mask=m_b, other=1.0)
        b_alive = b_alive & (b_u * b_qd < b_pd) & (j < b_nd)
        b_na += b_alive.to(tl.int64)
    tl.store(p_na + o_b, b_na, mask=m_b)

    o_t = o_prow + b_na * V  # offset of p[b, na]
    o_v = tl.arange(0, BLOCK_V)
    b_resid = b_na < b_nd  # a rejection happened: draw from the residual max(0, p - q)
    o_q = o_t  # no draft rows when K = 1; a placeholder the helper never reads
    if K > 1:
        o_q = o_b * s_q_b + tl.minimum(b_na, K - 2) * s_q_k  # offset of q[b, min(na, K-2)]
        # 1. does the residual have mass? (order-free: every term is >= 0)
        b_rsum = tl.zeros([BLOCK_B], tl.float32)
        for start in range(0, V, BLOCK_V):
            b_r, m_x = _chosen_weights(p_p, p_q, o_t, o_q, start + o_v, m_b, V, m_b, K)  # every row's residual
            b_rsum += tl.sum(b_r, 1)
        # p == q exactly makes a rejection impossible; fall back to p if rounding produced one
        b_resid = b_resid & (b_rsum > 0.0)

    # 2. the running prefix total of the chosen weights w (the last cdf value)
    b_c = tl.zeros([BLOCK_B], tl.float32)
    for start in range(0, V, BLOCK_V):
        b_w, m_x = _chosen_weights(p_p, p_q, o_t, o_q, start + o_v, m_b, V, b_resid, K)
        b_c += tl.max(tl.cumsum(b_w, 1), 1)  # = the block's last prefix (w >= 0), as pass 3 sees it
    b_thresh = tl.load(p_u + o_b * s_u_b + (K - 1) * s_u_k, mask=m_b, other=0.0) * b_c

    # 3. token = number of cdf values <= thresh (the cdf is non-decreasing)
    b_cnt = tl.zeros([BLOCK_B], tl.int64)
    b_c = tl.zeros([BLOCK_B], tl.float32)
    for start in range(0, V, BLOCK_V):
        b_w, m_x = _chosen_weights(p_p, p_q, o_t, o_q, start + o_v, m_b, V, b_resid, K)
        b_scan = tl.cumsum(b_w, 1)  # (BLOCK_B, BLOCK_V)
        b_cnt += tl.sum(((b_c[:, None] + b_scan <= b_thresh[:, None]) & m_x).to(tl.int64), 1)
        b_c += tl.max(b_scan, 1)
    tl.store(p_tok + o_b, tl.minimum(b_cnt, V - 1), mask=m_b)


def sample_meta(V: int, Bsz: int, cuda: bool, block_v: int | None = None) -> dict:
    """_verdict_sample_kernel's meta-parameters (scripts/compile_check.py compiles these); small vocabularies:
    several sequences per program, tiles of about 2k elements."""
    BLOCK_V = block_v or min(2048 if cuda else 1024, triton.next_power_of_2(V))
    return dict(BLOCK_V=BLOCK_V, BLOCK_B=min(max(1, 2048 // BLOCK_V), triton.next_power_of_2(Bsz), 256), num_warps=4)


def verdict_sample_plan(logits, draft_probs, drafts, nd, uniforms, temperature, top_k, top_p, filtered=True,
                        block_v=None, *, cuda: bool, n_sm: int):
    """The launch after the torch part (the filtered target probabilities); block_v overrides the V tile."""
    dims = _check.args(_ARGS, logits=logits, draft_probs=draft_probs, drafts=drafts, nd=nd,
                       uniforms=uniforms, temperature=temperature, top_k=top_k, top_p=top_p)
    Bsz, K, V, dev = dims.B, dims.K, dims.V, dims.device
    _check(K >= 1 and V >= 1, f"logits needs K >= 1 and V >= 1, got {tuple(logits.shape)}")
    na = torch.empty((Bsz,), dtype=torch.int64, device=dev)
    token = torch.empty((Bsz,), dtype=torch.int64, device=dev)
    if Bsz == 0:
        return [], (na, token)
    p = sampling_probs_ref(logits, temperature, top_k, top_p, filtered).contiguous()  # (B, K, V) fp32
    q, d = (draft_probs, drafts) if K > 1 else (p, na)  # K = 1: placeholders the kernel never reads
    meta = sample_meta(V, Bsz, cuda, block_v)
    return [Launch(_verdict_sample_kernel, (triton.cdiv(Bsz, meta["BLOCK_B"]),), (
        p, q, d, nd, uniforms, na, token, Bsz, V,
        q.stride(0), q.stride(1), d.stride(0), d.stride(1) if K > 1 else 0, uniforms.stride(0), uniforms.stride(1),
    ), dict(K=K, **meta))], (na, token)


def verdict_sample_bytes(B: int, K: int, V: int, act: int) -> dict:
    """The bytes one call moves, by tensor, at the least: the torch part reads the logits (act bytes an element)
    and the sampling settings and writes the filtered probabilities p (B, K, V) fp32 (its sort and scans move
    several times that, not counted); the kernel reads each sequence's row p[b, na] and, after a rejection is
    possible (K > 1), the draft row q[b, na], the K-1 values at the drafts in each, drafts, nd and uniforms,
    and writes na and the token."""
    return {"logits": B * K * V * act, "temperature, top_k, top_p": B * (4 + 8 + 4), "p written": B * K * V * 4,
            "p row": B * V * 4, "q row": B * V * 4 if K > 1 else 0, "p, q at drafts": 2 * B * (K - 1) * 4,
            "drafts, nd, uniforms": B * (K - 1) * 8 + B * 8 + B * K * 4, "na, token": 2 * B * 8}


def verdict_sample(logits, draft_probs, drafts, nd, uniforms, temperature, top_k, top_p, filtered=True):
    """Triton version of verdict_sample_ref (same signature; (na, token) equal for the same uniforms,
    up to the cumsum rounding discussed in the module docstring)."""
    return launch(verdict_sample_plan, logits, draft_probs, drafts, nd, uniforms, temperature, top_k, top_p,
                  filtered)
