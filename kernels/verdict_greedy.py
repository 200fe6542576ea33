"""Greedy verdict in one pass over the logits.

For logits (B, K, V): picks[b, j] = argmax (the first maximal index on ties),
logprobs[b, j] = log_softmax(logits[b, j])[picks[b, j]] = max - logsumexp, and
na[b] = the number of leading drafts equal to the pick of their row, clamped to
num_drafts[b] (the valid drafts; the rest of the (B, K-1) drafts are padding).
"""
import torch


def verdict_greedy_ref(logits, drafts, num_drafts):
    """logits (B, K, V), drafts (B, K-1) int64, num_drafts (B,) int64 ->
    (picks (B, K) int64, na (B,) int64, logprobs (B, K) fp32)."""
    lf = logits.float()
    picks = lf.argmax(-1)
    logprobs = lf.amax(-1) - torch.logsumexp(lf, -1)
    K = logits.shape[1]
    match = (drafts == picks[:, : K - 1]) & (torch.arange(K - 1, device=logits.device) < num_drafts[:, None])
    na = match.long().cumprod(-1).sum(-1)
    return picks, na, logprobs
