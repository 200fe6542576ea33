"""The model runner: every tensor of the engine lives here, none in the scheduler.

The scheduler hands it host-side sequences (slot, tokens, params) and gets back
host lists. Per slot it keeps the drafts proposed for the next verify (and their
distributions when sampling) and the request's random generator.

One speculative step, as the scheduler drives it (docs/DESIGN.md §4), with γ drafts per sequence
(fixed, or chosen per step by the planner; K = γ + 1 rows):
    step    = verify(seqs, γ)                  rows [last_token | drafts] -> logits (B, K, V), stashes written
    verdict = verdict(step, seqs)              accept counts and emitted tokens; the step's one device-to-host copy
    commit(step, verdict, active)              Mamba states rolled back to the accepted prefix (one launch)
    propose(seqs, step, verdict, active, γ')   the proposer drafts the next step's γ' rows
A `Step` and a `Verdict` are complete when made and are passed along, never parked here.
"""
from dataclasses import dataclass, fields, replace

import torch

from nano_spec.cache import HybridCache
from nano_spec.grammar import verify_bitmask
from nano_spec.model import HybridLM
from nano_spec.proposers import Drafts
from nano_spec.sampling import BatchSampling, SamplingParams, token_logprobs, verdict


@dataclass(frozen=True)
class Step:
    """One verify in flight: what went in, for the verdict, the commit and the proposer. Row b is seqs[b]."""
    slots: torch.Tensor                # (B,)
    seq_lens: torch.Tensor             # (B,) tokens in the caches before the step
    drafts: torch.Tensor               # (B, γ) the drafts verified
    num_drafts: torch.Tensor           # (B,) how many of them are real (the rest is padding)
    draft_probs: torch.Tensor | None   # (B, γ, V) q of each draft; None when every row is greedy
    sampling: BatchSampling
    kv_len: int                        # bound on the KV rows any call of this step reads
    logits: torch.Tensor               # (B, K, V)
    hidden: torch.Tensor               # (B, K, D) final-normed rows: the hidden stash that seeds the MTP

    def select(self, idx) -> "Step":
        """The rows idx (a long tensor) of every per-row field."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        rows = {name: v[idx] for name, v in values.items() if isinstance(v, torch.Tensor)}
        return replace(self, **rows, sampling=self.sampling.select(idx))


@dataclass(frozen=True)
class RowResult:
    """What the scheduler learns about one sequence from a verdict (host values)."""
    na: int                  # accepted drafts
    drafts: list             # the real drafts that were verified (nd = len(drafts))
    tokens: list             # emitted tokens in order: drafts[:na], then the target's pick
    logprobs: list | None    # per token: (logprob, {token: logprob} of the top-n)
    ok: bool                 # False: non-finite logits, the sequence ends with an error


@dataclass(frozen=True)
class Verdict:
    na: torch.Tensor         # (B,)
    emitted: torch.Tensor    # (B, K) emitted[b, j] for j <= na[b]: accepted drafts, then the target's pick
    rows: list               # RowResult per sequence

    def select(self, rows: list, idx) -> "Verdict":
        """The rows given as a host list and as a device tensor (no device-to-host copy)."""
        return Verdict(self.na[idx], self.emitted[idx], [self.rows[i] for i in rows])


@dataclass(frozen=True)
class Admission:
    """A prefilled sequence: its first token and what the proposer needs to draft after it."""
    result: RowResult
    hidden: torch.Tensor     # (T, D) final-normed prompt rows
    first: torch.Tensor      # (1,) the first token
    sampling: BatchSampling


class ModelRunner:
    def __init__(self, model: HybridLM, proposer, num_slots: int, max_seq_len: int):
        self.model, self.proposer = model.fuse_qkv(), proposer
        self.cfg = model.cfg
        self.gamma = proposer.num_drafts  # γ_max: drafts kept per slot; a step verifies γ <= γ_max of them
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # headroom past max_seq_len: a verify writes K rows and the MTP drafts γ more
        K = self.gamma + 1  # the most rows a verify can hold
        self.cache = HybridCache(self.cfg, num_slots, max_seq_len + 2 * K, K, self.device, self.dtype)
        self.drafts = torch.zeros(num_slots, self.gamma, dtype=torch.long, device=self.device)  # (S, γ)
        self.num_drafts = torch.zeros(num_slots, dtype=torch.long, device=self.device)         # (S,)
        self.draft_probs = None  # (S, γ, V), allocated on the first sampled request
        self.generators = [None] * num_slots
        # per-slot device copies, written at admission and advanced on the device after each verdict,
        # so a step uploads nothing but the batch's slot ids (and those only when the batch changes)
        self.seq_lens = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # (S,)
        self.last = torch.zeros(num_slots, dtype=torch.long, device=self.device)      # (S,) last emitted token
        self.sampling = BatchSampling.of([SamplingParams()] * num_slots, self.device)
        self._batch = ((), None)  # (slot ids, their device tensor)

    # ---- helpers ------------------------------------------------------------------
    def _tensor(self, values, dtype=torch.long):
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _slots(self, seqs):
        key = tuple(s.slot for s in seqs)
        if key != self._batch[0]:
            self._batch = (key, self._tensor(key))
        return self._batch[1]

    def _uniforms(self, seqs, n: int):
        """(B, n) uniforms, each row from its sequence's own generator (reproducible per request)."""
        return torch.stack([torch.rand(n, generator=self.generators[s.slot], device=self.device) for s in seqs])

    def _draft_probs(self):
        if self.draft_probs is None:
            self.draft_probs = torch.zeros(self.cache.num_slots, self.gamma, self.cfg.vocab_size, device=self.device)
        return self.draft_probs

    # ---- 1. admission --------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, seq) -> Admission:
        """Run a new sequence's prompt into its (reset) slot and pick its first token."""
        self.cache.reset_slot(seq.slot)
        seed = seq.params.seed if seq.params.seed is not None else int(torch.randint(2**62, ()))
        self.generators[seq.slot] = torch.Generator(device=self.device).manual_seed(seed)
        hidden = self.model.prefill(self._tensor(seq.tokens), seq.slot, self.cache)  # (T, D)
        logits = self.model.logits(hidden[-1:])  # (1, V)
        sampling = BatchSampling.of([seq.params], self.device)
        self.sampling.write(seq.slot, sampling)
        u = None if sampling.all_greedy else self._uniforms([seq], 1)[:, 0]  # draw "first token"
        mask = None if seq.constraint is None else seq.constraint.mask()[None].to(self.device)  # (1, W)
        tok, _ = sampling.pick(logits, u, mask)
        self.seq_lens[seq.slot] = len(seq.tokens)
        self.last[seq.slot] = tok[0]
        zero = torch.zeros_like(tok)  # (1,): no drafts, none accepted
        result = self._host_results(logits[:, None], tok[:, None], zero, zero[:, None][:, :0], zero, [seq])[0]
        return Admission(result, hidden, tok, sampling)

    # ---- 2. verify, then verdict ----------------------------------------------------------
    @torch.no_grad()
    def verify(self, seqs, gamma: int) -> Step:
        """One batched forward over rows [last_token | first γ drafts] of every sequence (B, K = γ + 1)."""
        B, K = len(seqs), gamma + 1
        slots = self._slots(seqs)
        seq_lens = self.seq_lens[slots]
        drafts = self.drafts[slots, :gamma]  # (B, γ)
        rows = torch.cat([self.last[slots, None], drafts], dim=1)  # (B, K)
        kv_len = max(s.seq_len for s in seqs) + K + self.gamma
        logits = self.model.verify(rows, slots, seq_lens, self.cache, kv_len)  # (B, K, V)
        sampling = self.sampling.select(slots, all(s.params.greedy for s in seqs))
        draft_probs = None if sampling.all_greedy else self._draft_probs()[slots, :gamma]
        return Step(slots, seq_lens, drafts, self.num_drafts[slots].clamp(max=gamma), draft_probs, sampling, kv_len,
                    logits, self.cache.hidden_stash(B, K))

    def bitmask(self, step: Step, seqs) -> torch.Tensor:
        """(B, K, W) grammar masks of the verified rows (at least one of seqs is constrained): row j of a
        constrained sequence allows what may follow its drafts[:j] (docs/DESIGN.md §11)."""
        return verify_bitmask([s.constraint for s in seqs], step.drafts, step.num_drafts)

    @torch.no_grad()
    def verdict(self, step: Step, seqs, bitmask=None) -> Verdict:
        """Accept counts and emitted tokens of the verified rows, judged on the device, copied once."""
        u = None if step.sampling.all_greedy else self._uniforms(seqs, step.logits.shape[1])  # draw "verdict"
        na, emitted = verdict(self.model.ops, step.logits, step.drafts, step.num_drafts, step.sampling,
                              step.draft_probs, u, bitmask)
        self.seq_lens[step.slots] = step.seq_lens + na + 1  # the device copies follow the host, no copy back
        self.last[step.slots] = emitted.gather(1, na[:, None])[:, 0]
        return Verdict(na, emitted, self._host_results(step.logits, emitted, na, step.drafts, step.num_drafts, seqs))

    def _host_results(self, logits, emitted, na, drafts, num_drafts, seqs) -> list:
        """One device-to-host copy per step: na, emitted tokens, drafts, finiteness (and logprobs if asked)."""
        # only rows 0..na are used (padding rows and rows past a rejection are not): only they must be finite
        unused = torch.arange(logits.shape[1], device=logits.device) > na[:, None]  # (B, K)
        finite = (torch.isfinite(logits).all(-1) | unused).all(-1)  # (B,)
        packed = torch.cat([na[:, None], num_drafts[:, None], finite[:, None].long(), emitted, drafts], 1).tolist()
        top_n = max(s.params.logprobs for s in seqs)
        if top_n:  # chosen (B, K), top values and ids (B, K, n) as host lists
            chosen, top_v, top_i = (t.tolist() for t in token_logprobs(logits, emitted, top_n))
        K, out = emitted.shape[1], []
        for b, (row, s) in enumerate(zip(packed, seqs)):
            n, nd, ok, k = *row[:3], s.params.logprobs
            lp = [(chosen[b][j], dict(zip(top_i[b][j][:k], top_v[b][j][:k]))) for j in range(n + 1)] if k else None
            out.append(RowResult(na=n, drafts=row[3 + K : 3 + K + nd], tokens=row[3 : 4 + n], logprobs=lp,
                                 ok=bool(ok)))
        return out

    # ---- 3. commit, 4. propose: batched, with per-sequence fault isolation ----------------
    def _isolated(self, fn, active: list) -> tuple:
        """Run fn(rows) on all active rows at once; if that raises, retry each row alone so that a fault
        stays with the sequence it belongs to. Returns (per-row success, per-row error message or None)."""
        rows = [i for i, a in enumerate(active) if a]
        ok, errors = list(active), [None] * len(active)
        try:
            if rows:
                fn(rows)
        except Exception:
            for i in rows:
                try:
                    fn([i])
                except Exception as e:
                    ok[i], errors[i] = False, f"{fn.__name__}: {type(e).__name__}: {e}"
        return ok, errors

    @torch.no_grad()
    def commit(self, step: Step, verdict: Verdict, active: list) -> tuple:
        """Roll every Mamba layer of each active sequence that rejected a draft back to its accepted prefix
        (docs/DESIGN.md §3): one launch for all layers and sequences. Returns (per-row success, error)."""
        B, K = step.logits.shape[:2]
        # the host knows na: a full accept (and every step of plain decoding) leaves the live state right
        need = [a and r.na < K - 1 for a, r in zip(active, verdict.rows)]  # none: _isolated launches nothing

        def commit_state(rows):
            mask = self._tensor([i in rows for i in range(B)], torch.bool)
            self.model.ops.commit_state(self.cache.ssm_state, self.cache.conv_state, self.cache.ssm_stash(B, K),
                                        self.cache.conv_stash(B, K), step.slots, verdict.na, mask)

        ok, errors = self._isolated(commit_state, need)
        return [good or not n for good, n in zip(ok, need)], errors

    @torch.no_grad()
    def propose_first(self, seq, adm: Admission, gamma: int) -> bool:
        """γ drafts for a newly admitted sequence. False: drafting failed, it goes on without drafts."""
        if not self.gamma:  # plain decoding; with γ = 0 of γ_max > 0 the MTP still catches up
            return True
        u = None if adm.sampling.all_greedy else self._uniforms([seq], gamma)  # draw "drafts"
        try:
            self._store([seq], self.proposer.first(self.model, self.cache, seq, adm.hidden, adm.first, adm.sampling,
                                                   u, gamma))
            return True
        except Exception:
            self._store([seq], None)
            return False

    @torch.no_grad()
    def propose(self, seqs, step: Step, verdict: Verdict, active: list, gamma: int) -> list:
        """γ drafts for the next step of the sequences still running. Returns per-row success; a row whose
        drafting failed goes on without drafts (its next verify has nd = 0)."""
        if not self.gamma:  # plain decoding; γ = 0 of γ_max > 0 still calls the proposer (its catch-up)
            return list(active)
        live = [i for i, a in enumerate(active) if a]
        u = None if step.sampling.all_greedy or not live else self._uniforms([seqs[i] for i in live], gamma)

        def propose(rows):  # rows index the batch; u was drawn once, so a retry sees the same numbers
            sub, st, vd, uu = [seqs[i] for i in rows], step, verdict, u
            if len(rows) < len(seqs):  # a part of the batch (the whole batch needs no selection uploaded)
                idx = self._tensor(rows)
                st, vd = step.select(idx), verdict.select(rows, idx)
                uu = None if u is None else u[[live.index(i) for i in rows]]
            self._store(sub, self.proposer.next(self.model, self.cache, sub, st, vd, uu, gamma))

        ok = self._isolated(propose, active)[0]
        self._store([s for s, a, good in zip(seqs, active, ok) if a and not good], None)
        return ok

    def _store(self, seqs, drafts: Drafts | None):
        """Keep each sequence's drafts in its slot until the next verify; None: no drafts."""
        if not seqs:
            return
        slots = self._slots(seqs)
        if drafts is None:
            self.num_drafts[slots] = 0
            return
        R, g = drafts.tokens.shape
        if R != len(seqs) or g > self.gamma or drafts.num.shape != (R,):
            raise ValueError(f"proposer returned drafts of shape {tuple(drafts.tokens.shape)} for "
                             f"{len(seqs)} sequences and γ <= {self.gamma}")
        self.drafts[slots, :g] = drafts.tokens
        self.num_drafts[slots] = drafts.num.clamp(0, g)
        if any(not s.params.greedy for s in seqs):
            q = drafts.probs
            if q is None:  # a deterministic draft has q = one-hot
                q = torch.zeros(R, g, self.cfg.vocab_size, device=self.device)
                q.scatter_(-1, drafts.tokens[..., None], 1.0)
            self._draft_probs()[slots, :g] = q
