"""Sampled verdict: the lossless rejection rule (SPEC §4).

Per sequence with target probabilities p_j (temperature, top-k, top-p applied to
the logits of row j) and the draft probabilities q_j the drafts were sampled from:
  - draft j < nd is accepted when u[j] * q_j(d_j) < p_j(d_j)  (probability min(1, p/q));
  - na = the number of leading accepts;
  - the emitted token v ~ normalize(max(0, p_na - q_na)) after a rejection, or
    v ~ p_nd after a full accept, drawn by inverse CDF with u[K-1].
"""
import torch


def sampling_probs_ref(logits, temperature, top_k, top_p):
    """logits (B, R, V); temperature (B,) > 0, top_k (B,) int (0 = off), top_p (B,) in (0, 1] ->
    probs (B, R, V) fp32. top-k keeps the k largest; top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p (at least one token). Applied to draft and target alike."""
    lf = logits.float() / temperature[:, None, None]
    V = lf.shape[-1]
    sorted_l, order = lf.sort(-1, descending=True)
    rank = torch.arange(V, device=lf.device)
    k = torch.where(top_k > 0, top_k, V)[:, None, None]
    keep = rank < k  # (B, R, V) in sorted order
    sorted_l = sorted_l.masked_fill(~keep, float("-inf"))
    sp = sorted_l.softmax(-1)
    mass_before = sp.cumsum(-1) - sp
    keep = keep & (mass_before < top_p[:, None, None])
    keep[..., 0] = True
    sp = sp.masked_fill(~keep, 0.0)
    sp = sp / sp.sum(-1, keepdim=True)
    return torch.zeros_like(sp).scatter(-1, order, sp)


def verdict_sample_ref(logits, draft_probs, drafts, num_drafts, uniforms, temperature, top_k, top_p):
    """logits (B, K, V); draft_probs (B, K-1, V); drafts (B, K-1) int64; num_drafts (B,) int64;
    uniforms (B, K) in [0, 1); temperature, top_k, top_p (B,) -> (na (B,) int64, token (B,) int64)."""
    Bsz, K, V = logits.shape
    p = sampling_probs_ref(logits, temperature, top_k, top_p)  # (B, K, V)
    rows = torch.arange(Bsz, device=logits.device)
    if K > 1:
        p_d = p[:, : K - 1].gather(-1, drafts[..., None])[..., 0]  # (B, K-1)
        q_d = draft_probs.float().gather(-1, drafts[..., None])[..., 0]
        ok = (uniforms[:, : K - 1] * q_d < p_d) & (torch.arange(K - 1, device=logits.device) < num_drafts[:, None])
        na = ok.long().cumprod(-1).sum(-1)
    else:
        na = torch.zeros(Bsz, dtype=torch.long, device=logits.device)
    target = p[rows, na]  # (B, V)
    rejected = na < num_drafts
    if K > 1:
        q_na = draft_probs.float()[rows, na.clamp(max=K - 2)]
        resid = (target - q_na).clamp(min=0)
        # p == q exactly makes a rejection impossible; fall back to p if rounding produced one
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, target)
        target = torch.where(rejected[:, None], resid, target)
    cdf = target.cumsum(-1)
    thresh = uniforms[:, K - 1 : K] * cdf[:, -1:]
    token = (cdf <= thresh).sum(-1).clamp(max=V - 1)
    return na, token
