"""Draft proposers: where the γ tokens that a step verifies come from.

A proposer is any object with

    num_drafts                                            γ_max, the most drafts a step asks for
    first(model, cache, seq, hidden, first, sampling, uniforms, gamma) -> Drafts
        γ drafts for a newly admitted sequence; hidden (T, D) are its prompt rows, first (1,) its first token
    next(model, cache, seqs, step, verdict, uniforms, gamma) -> Drafts
        γ drafts after a verify, for the sequences seqs (row i of step and verdict is seqs[i])

It returns its drafts and never writes engine state; `uniforms` (R, γ) is its own
random draw (None when every row is greedy). γ <= γ_max is fixed or chosen per step
(planner.py); it may be 0, and a proposer with state (the MTP head's KV rows) must
still advance it then. A sequence with a grammar carries its `constraint`
(nano_spec/grammar.py): drafts the grammar refuses are only ever rejected, and a
sampled draft's q must be the masked distribution it was drawn from (DESIGN §11).
`LLM(proposer=...)` takes a name or such an object.

`none`  plain decoding (γ = 0).
`ngram` prompt lookup: the continuation of the latest earlier occurrence of the
        last n tokens (n = max_n .. 1); works with any checkpoint.
`mtp`   the checkpoint's MTP head (docs/DESIGN.md §2, §4): catch-up over the verified
        rows, the output at the last accepted row gives draft 1, γ-1 recursive steps the rest.
"""
from dataclasses import dataclass

import torch

from nano_spec.config import is_int
from nano_spec.grammar import DraftMasks


@dataclass(frozen=True)
class Drafts:
    """What a proposer returns for R sequences."""
    tokens: torch.Tensor        # (R, γ) long; rows with fewer drafts are padded with 0
    num: torch.Tensor           # (R,) long, the real drafts of each row
    probs: torch.Tensor | None  # (R, γ, V) the q each draft was drawn from; None: deterministic (one-hot q)

    @classmethod
    def from_lists(cls, lists: list, gamma: int, device) -> "Drafts":
        lists = [list(d[:gamma]) for d in lists]
        padded = [d + [0] * (gamma - len(d)) for d in lists]
        return cls(torch.tensor(padded, dtype=torch.long, device=device).view(len(lists), gamma),
                   torch.tensor([len(d) for d in lists], dtype=torch.long, device=device), None)


def ngram_lookup(tokens: list, num_drafts: int, max_n: int = 3) -> list:
    """Up to γ tokens that followed the latest earlier occurrence of the longest matching suffix."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), 0, -1):
        tail = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):  # latest first; the suffix itself is excluded
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + num_drafts]
    return []


class NoProposer:
    num_drafts = 0


class NgramProposer:
    def __init__(self, num_drafts: int, max_n: int = 3):
        self.num_drafts, self.max_n = num_drafts, max_n

    def first(self, model, cache, seq, hidden, first, sampling, uniforms, gamma) -> Drafts:
        return self.next(model, cache, [seq], None, None, uniforms, gamma)

    def next(self, model, cache, seqs, step, verdict, uniforms, gamma) -> Drafts:
        found = [ngram_lookup(s.tokens, gamma, self.max_n) for s in seqs]
        found = [d if s.constraint is None else d[: s.constraint.valid_prefix(d)] for d, s in zip(found, seqs)]
        return Drafts.from_lists(found, gamma, next(model.parameters()).device)


class MTPProposer:
    def __init__(self, num_drafts: int):
        self.num_drafts = num_drafts

    def first(self, model, cache, seq, hidden, first, sampling, uniforms, gamma) -> Drafts:
        """Catch-up over the prompt rows 0..T-1 (next tokens x_1..x_{T-1}, v), then draft."""
        T, device = hidden.shape[0], hidden.device
        next_ids = torch.cat([torch.tensor(seq.tokens[1:T], dtype=torch.long, device=device), first])  # (T,)
        o = model.mtp_prefill(next_ids, hidden, seq.slot, cache)  # (T, D)
        slots = torch.tensor([seq.slot], device=device)
        pos = torch.tensor([T], device=device)
        return self._draft(model, cache, [seq], slots, o[-1:], pos, sampling, uniforms, gamma, kv_len=T + gamma)

    def next(self, model, cache, seqs, step, verdict, uniforms, gamma) -> Drafts:
        """Catch-up over the K verified rows at MTP positions seq_len.., next tokens = the emitted row;
        rows past na are computed but lie beyond the new frontier and are overwritten later."""
        o = model.mtp_step(verdict.emitted, step.hidden, step.slots, step.seq_lens, cache, step.kv_len)  # (R, K, D)
        seed = model.ops.gather_rows(o, verdict.na)  # (R, D): the row of the last accepted position
        return self._draft(model, cache, seqs, step.slots, seed, step.seq_lens + verdict.na + 1, step.sampling,
                           uniforms, gamma, step.kv_len)

    def _draft(self, model, cache, seqs, slots, o, pos, sampling, uniforms, gamma, kv_len) -> Drafts:
        """o (R, D): the MTP output at position pos-1 -> γ drafts.

        Step i > 1 feeds the previous draft and the previous MTP output at position pos + i - 2.
        A constrained row picks draft i under the mask of its grammar after drafts 1..i-1.
        """
        if not gamma:  # the catch-up above kept the MTP's KV rows in step; no drafts this time
            return Drafts(slots.new_zeros(len(slots), 0), slots.new_zeros(len(slots)), None)
        drafts, probs = [], []
        masks = DraftMasks([s.constraint for s in seqs], gamma, slots.device)
        try:
            for i in range(gamma):
                tok, q = sampling.pick(model.mtp_logits(o), None if uniforms is None else uniforms[:, i], masks.mask())
                drafts.append(tok)
                probs.append(q)
                if i + 1 < gamma:
                    masks.push(tok, i)
                    o = model.mtp_step(tok[:, None], o[:, None], slots, pos + i, cache, kv_len)[:, 0]
        finally:
            masks.close()
        num = torch.tensor(masks.num, device=slots.device) if masks.on else torch.full_like(slots, gamma)
        return Drafts(torch.stack(drafts, dim=1), num, None if sampling.all_greedy else torch.stack(probs, dim=1))


AUTO_MAX_DRAFTS = 4  # γ_max under num_drafts="auto"; each extra draft also costs stash memory per slot


def make_proposer(proposer, num_drafts, has_mtp: bool):
    """proposer: a name in {auto, mtp, ngram, none} (auto = mtp when the checkpoint has an MTP head, else
    ngram), or an object with num_drafts, first() and next() (see the module docstring).
    num_drafts: γ, or "auto" (γ_max = AUTO_MAX_DRAFTS; the planner picks γ per step)."""
    if not isinstance(proposer, str):
        n = getattr(proposer, "num_drafts", None)
        if not is_int(n, 0, 16):
            raise ValueError(f"proposer: {type(proposer).__name__} needs an integer num_drafts in [0, 16], got {n!r}")
        if n and not all(callable(getattr(proposer, m, None)) for m in ("first", "next")):
            raise ValueError(f"proposer: {type(proposer).__name__} needs methods first() and next()")
        return proposer
    if proposer not in ("auto", "mtp", "ngram", "none"):
        raise ValueError(f"proposer: {proposer!r} is not one of auto, mtp, ngram, none")
    if num_drafts == "auto":
        num_drafts = AUTO_MAX_DRAFTS
    if not is_int(num_drafts, 0, 16):
        raise ValueError(f"num_drafts: {num_drafts!r} must be 'auto' or an integer in [0, 16]")
    if proposer == "none" or num_drafts == 0:
        return NoProposer()
    if proposer == "auto":
        proposer = "mtp" if has_mtp else "ngram"
    if proposer == "mtp":
        if not has_mtp:
            raise ValueError("proposer: 'mtp' needs a checkpoint with an MTP head (num_nextn_predict_layers: 1); "
                             "use 'ngram'")
        return MTPProposer(num_drafts)
    return NgramProposer(num_drafts)
