"""What a drafter is: its interface, what it returns, and the picking that drafters share (docs/DESIGN.md §4).
The built-ins are none (plain decoding, γ = 0), ngram.py, mtp.py and dflash.py, each a drafter as it is.

A drafter keeps its own state, indexed by `seq.slot`, and never writes the engine's. `uniforms` (B, γ) is its
random draw, None when every row is greedy. γ <= γ_max is fixed or chosen per step (nano_spec/engine/planner.py);
draft is not called at γ = 0, but catch_up is. A sequence with a grammar carries its `constraint`
(nano_spec/text/grammar.py): drafts the grammar refuses are only ever rejected, and a sampled draft's q must be the
masked distribution it was drawn from (DESIGN §11). `LLM(proposer=...)` takes a name or an object with max_drafts,
admit, draft and catch_up (taps optional), wrapped once, at that boundary, in `Checked` (the built-ins' ids come
from the model's logits or the sequence's own tokens, so they need no check).
"""
from contextlib import closing
from dataclasses import dataclass
from typing import Protocol

import torch

from nano_spec.model.sampling import BatchSampling
from nano_spec.text.grammar import DraftMasks


@dataclass(frozen=True)
class Drafts:
    """What a drafter returns for B sequences."""
    tokens: torch.Tensor        # (B, γ) long, every id in [0, V); rows with fewer drafts are padded (with 0)
    nd: torch.Tensor            # (B,) long, the real drafts of each row
    probs: torch.Tensor | None  # (B, γ, V) the q each draft was drawn from; None: deterministic (one-hot q)
    refused: torch.Tensor | None = None  # (B,) bool: rows whose drafts Checked refused (verified with none)

    @classmethod
    def from_lists(cls, lists: list, gamma: int, device) -> "Drafts":
        lists = [list(d[:gamma]) for d in lists]
        padded = [d + [0] * (gamma - len(d)) for d in lists]
        return cls(torch.tensor(padded, dtype=torch.long, device=device).view(len(lists), gamma),
                   torch.tensor([len(d) for d in lists], dtype=torch.long, device=device), None)


@dataclass(frozen=True)
class VerifiedRows:
    """One verify's rows, for a drafter's catch-up. Row j of sequence b sits at position seq_lens[b] + j."""
    slots: torch.Tensor     # (B,)
    seq_lens: torch.Tensor  # (B,) tokens in the caches before the step
    tokens: torch.Tensor    # (B, K) the token emitted after each row (valid for j <= na)
    hidden: torch.Tensor    # (B, K, D) final-normed hidden of each row
    tapped: torch.Tensor | None = None  # (B, K, nT*D) the residual after each layer in the drafter's taps, if any


def pick_in_order(sampling: BatchSampling, gamma: int, uniforms, logits_of, masks: DraftMasks | None = None) -> Drafts:
    """γ drafts picked one position at a time: draft i from logits_of(i, draft i-1) (B, V), drawn with uniforms[:, i]
    on sampled rows. With masks (the batch has a grammar: host work, so it runs eager), a constrained row picks under
    its grammar's mask after the drafts before it (DESIGN §11); the caller closes them."""
    tokens, probs, tok = [], [], None
    for i in range(gamma):
        tok, q = sampling.pick(logits_of(i, tok), None if uniforms is None else uniforms[:, i],
                               None if masks is None else masks.mask())
        tokens.append(tok)
        probs.append(q)
        if masks is not None and i + 1 < gamma:
            masks.push(tok, i)
    tokens = torch.stack(tokens, dim=1)  # (B, γ)
    nd = torch.tensor(masks.num, device=tok.device) if masks is not None else torch.full_like(tok, gamma)
    return Drafts(tokens, nd, None if sampling.all_greedy else torch.stack(probs, dim=1))


class NoDrafter:
    """Plain decoding: with max_drafts 0 the runner calls none of the methods."""
    max_drafts, taps = 0, ()

    @staticmethod
    def state_bytes(cfg, num_slots: int, max_len: int, dtype) -> int:
        return 0


class Drafter(Protocol):
    """What every drafter has (docs/DESIGN.md §4). The built-ins also give the bytes of their state before it is
    allocated, `state_bytes(cfg, num_slots, max_len, dtype)`, which the memory check counts."""
    max_drafts: int  # γ_max, the most drafts a step asks for
    taps: tuple      # the target layers whose rows it reads (a block drafter); () for the others

    def admit(self, seq, hidden, first, tapped=None) -> None:
        """A new sequence: hidden (T, D) its final-normed prompt rows, first (1,) its first token, tapped (T, nT*D)
        the rows of the layers in taps (None without taps)."""

    def draft(self, seqs, gamma: int, uniforms) -> Drafts:
        """γ drafts per sequence, at the start of a step."""

    def catch_up(self, seqs, rows: VerifiedRows, na) -> None:
        """After the accept rule: the step's verified rows, na (B,) the accepted drafts."""


class DeviceDrafter:
    """A drafter whose work is device work over the batch's slots (the MTP head, DFlash). The step runs its
    `draft_rows` and `catch_up_rows` inside its one graph (nano_spec/engine/graph.py), with the step's sampling
    settings and KV bound; `draft` and `catch_up`, the Drafter interface, call them from host sequences (and so
    take a grammar's masks, which no graph can)."""
    max_drafts: int
    taps: tuple = ()
    nets: tuple = ()  # the networks its drafts run (an MTP head's lies inside the target), packed in int8 (graph.py)
    device: torch.device

    def draft_rows(self, slots, gamma: int, sampling: BatchSampling, uniforms, kv: int, masks=None) -> Drafts:
        """γ drafts for slots (B,), picked under sampling (the batch's rows), reading at most kv KV rows."""
        raise NotImplementedError

    def catch_up_rows(self, rows: VerifiedRows, na, kv: int) -> None:
        """After the accept rule: the step's verified rows and na (B,), reading at most kv KV rows."""
        raise NotImplementedError

    def draft(self, seqs, gamma: int, uniforms) -> Drafts:
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        sampling = BatchSampling.of([s.params for s in seqs], self.device)
        kv = max(s.seq_len for s in seqs) + gamma + 1
        with closing(DraftMasks([s.constraint for s in seqs], [gamma] * len(seqs), self.device)) as masks:
            return self.draft_rows(slots, gamma, sampling, uniforms, kv, masks if masks.on else None)

    def catch_up(self, seqs, rows: VerifiedRows, na) -> None:
        self.catch_up_rows(rows, na, max(s.seq_len for s in seqs) + rows.tokens.shape[1])


class Checked:
    """An outside drafter at the boundary. Its taps are read once; its drafts are checked every step: a wrong
    shape is its fault for the whole batch (the step fails); a draft id outside [0, V) refuses only its row,
    checked on the device, and the flag travels with the step's one copy (the row is verified with no drafts
    meanwhile). Drafts made on another device (a host-side drafter on a CUDA engine) are moved."""

    def __init__(self, inner, vocab_size: int, device):
        self.inner, self.vocab_size, self.device = inner, vocab_size, device
        self.max_drafts = inner.max_drafts
        self.taps = tuple(getattr(inner, "taps", ()))

    def admit(self, seq, hidden, first, tapped=None):
        self.inner.admit(seq, hidden, first, **({"tapped": tapped} if self.taps else {}))

    def catch_up(self, seqs, rows, na):
        self.inner.catch_up(seqs, rows, na)

    def draft(self, seqs, gamma: int, uniforms) -> Drafts:
        drafts, B, V = self.inner.draft(seqs, gamma, uniforms), len(seqs), self.vocab_size
        t, nd, q = (None if x is None else x.to(self.device) for x in (drafts.tokens, drafts.nd, drafts.probs))
        if t.shape != (B, gamma) or nd.shape != (B,) or t.is_floating_point() or nd.is_floating_point() or (
                q is not None and q.shape != (B, gamma, V)):
            raise ValueError(f"proposer: drafts {tuple(t.shape)}, nd {tuple(nd.shape)}, probs "
                             f"{None if q is None else tuple(q.shape)} for B={B}, γ={gamma}; expected integer "
                             f"({B}, {gamma}), ({B},) and None or ({B}, {gamma}, {V})")
        safe = t.clamp(0, V - 1)
        refused = (safe != t).any(1)  # (B,)
        return Drafts(safe, torch.where(refused, 0, nd.clamp(0, gamma)), q, refused)
