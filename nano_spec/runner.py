"""The model runner: every tensor of the engine lives here, none in the scheduler.

The scheduler hands it host-side sequences (slot, tokens, params) and gets back
host lists. Per slot it keeps the drafts proposed for the next verify (and the
draft distributions when sampling) and a random generator.

One speculative step, as the scheduler drives it:
    verify(seqs)   -> rows = [last_token | drafts] -> logits (B, K, V)
    verdict(seqs)  -> accept counts and emitted tokens; the step's one device-to-host copy
    commit(ok)     -> Mamba states rolled back to the accepted prefix (one launch, all layers)
    propose(seqs)  -> the proposer drafts the next rows (MTP catch-up + recursive drafts, or n-grams)
"""
from dataclasses import dataclass

import torch

from nano_spec.cache import HybridCache
from nano_spec.model import HybridLM
from nano_spec.sampling import BatchSampling, token_logprobs, verdict


@dataclass
class StepState:
    """The tensors of the step in flight, between verify and propose."""
    slots: torch.Tensor      # (B,)
    seq_lens: torch.Tensor   # (B,) before the step
    drafts: torch.Tensor     # (B, γ) the drafts verified
    num_drafts: torch.Tensor  # (B,) how many of them are real (the rest is padding)
    na: torch.Tensor | None  # (B,), set by the verdict
    emitted: torch.Tensor | None   # (B, K), set by the verdict
    sampling: BatchSampling | None
    uniforms: torch.Tensor | None  # (B, K + γ) when some row samples
    kv_len: int              # bound on the KV rows any call of this step reads


@dataclass
class RowResult:
    """What the scheduler learns about one sequence from a verify."""
    na: int
    tokens: list             # emitted tokens in order: accepted drafts, then the target's pick
    logprobs: list | None    # per token: (logprob, {token: logprob} of the top-n)
    ok: bool                 # False: non-finite logits, the sequence ends with an error


class ModelRunner:
    def __init__(self, model: HybridLM, proposer, num_slots: int, max_seq_len: int):
        self.model, self.proposer = model, proposer
        self.cfg = model.cfg
        self.gamma = proposer.num_drafts
        self.K = self.gamma + 1
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # headroom past max_seq_len: a verify writes K rows and the MTP drafts γ more
        self.cache = HybridCache(self.cfg, num_slots, max_seq_len + 2 * self.K, self.K, self.device, self.dtype)
        self.drafts = torch.zeros(num_slots, self.gamma, dtype=torch.long, device=self.device)  # (S, γ)
        self.num_drafts = torch.zeros(num_slots, dtype=torch.long, device=self.device)         # (S,)
        self.draft_probs = None  # (S, γ, V), allocated on the first sampled request
        self.generators = [None] * num_slots
        self.step_state = None
        self.logits = None

    # ---- helpers ------------------------------------------------------------------
    def _tensor(self, values, dtype=torch.long):
        return torch.tensor(values, dtype=dtype, device=self.device)

    def uniforms(self, seqs, n: int):
        """(B, n) uniforms, each row from its sequence's own generator (reproducible per request)."""
        return torch.stack([torch.rand(n, generator=self.generators[s.slot], device=self.device) for s in seqs])

    def need_draft_probs(self):
        if self.draft_probs is None:
            self.draft_probs = torch.zeros(self.cache.num_slots, self.gamma, self.cfg.vocab_size, device=self.device)
        return self.draft_probs

    # ---- 1. admission --------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, seq) -> RowResult:
        """Run a new sequence's prompt into its (reset) slot and pick its first token."""
        self.cache.reset_slot(seq.slot)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seq.params.seed if seq.params.seed is not None else int(torch.randint(2**62, ())))
        self.generators[seq.slot] = gen
        ids = self._tensor(seq.tokens)
        hidden = self.model.prefill(ids, seq.slot, self.cache)  # (T, D)
        logits = self.model.logits(hidden[-1:])  # (1, V)
        sampling = BatchSampling.of([seq.params], self.device)
        u = None if sampling.all_greedy else self.uniforms([seq], 1)[:, 0]
        tok, _ = sampling.pick(logits, u)
        result = self._host_results(logits[:, None], tok[:, None], torch.zeros_like(tok), [seq])[0]
        if result.ok and self.gamma:
            self.proposer.after_prefill(self, seq, hidden, tok)
        return result

    # ---- 2. verify, then verdict ----------------------------------------------------------
    @torch.no_grad()
    def verify(self, seqs):
        """One batched forward over rows [last_token | drafts] of every sequence (B, K)."""
        K = self.K
        slots = self._tensor([s.slot for s in seqs])
        seq_lens = self._tensor([s.seq_len for s in seqs])
        last = self._tensor([s.tokens[-1] for s in seqs])
        drafts = self.drafts[slots]  # (B, γ)
        rows = torch.cat([last[:, None], drafts], dim=1)  # (B, K)
        kv_len = max(s.seq_len for s in seqs) + K + self.gamma
        self.logits = self.model.verify(rows, slots, seq_lens, self.cache, kv_len)  # (B, K, V)
        self.step_state = StepState(slots, seq_lens, drafts, self.num_drafts[slots], None, None, None, None, kv_len)

    @torch.no_grad()
    def verdict(self, seqs) -> list:
        """Accept counts and emitted tokens for the verified rows -> a RowResult per sequence."""
        st, K = self.step_state, self.K
        st.sampling = BatchSampling.of([s.params for s in seqs], self.device)
        st.uniforms = None if st.sampling.all_greedy else self.uniforms(seqs, K + self.gamma)
        draft_probs = None if st.sampling.all_greedy else self.need_draft_probs()[st.slots]
        st.na, st.emitted = verdict(self.model.ops, self.logits, st.drafts, st.num_drafts, st.sampling, draft_probs,
                                    None if st.uniforms is None else st.uniforms[:, :K])
        return self._host_results(self.logits, st.emitted, st.na, seqs)

    def _host_results(self, logits, emitted, na, seqs) -> list:
        """One device-to-host copy per step: na, emitted tokens, finiteness (and logprobs if asked)."""
        finite = torch.isfinite(logits).flatten(1).all(-1)  # (B,)
        packed = torch.cat([na[:, None], emitted, finite[:, None].long()], dim=1).tolist()
        top_n = max(s.params.logprobs for s in seqs)
        lps = None
        if top_n:
            chosen, top_v, top_i = token_logprobs(logits, emitted, top_n)
            lps = (chosen.tolist(), top_v.tolist(), top_i.tolist())
        out = []
        for b, (row, s) in enumerate(zip(packed, seqs)):
            n = row[0]
            toks = row[1 : 2 + n]
            lp = None
            if s.params.logprobs:
                k = s.params.logprobs
                lp = [(lps[0][b][j], dict(zip(lps[2][b][j][:k], lps[1][b][j][:k]))) for j in range(n + 1)]
            out.append(RowResult(na=n, tokens=toks, logprobs=lp, ok=bool(row[-1])))
        return out

    # ---- 3. commit, 4. propose: batched, with per-sequence fault isolation ----------------
    def _isolated(self, fn, seqs, active: list) -> list:
        """Run fn(rows) on all active rows at once; if that raises, retry each row alone so a fault
        ends only the sequence it belongs to. Returns per-row success; failures are noted on the seq."""
        rows = [i for i, a in enumerate(active) if a]
        if not rows:
            return list(active)
        try:
            fn(rows)
            return list(active)
        except Exception:
            ok = [False] * len(active)
            for i in rows:
                try:
                    fn([i])
                    ok[i] = True
                except Exception as e:  # the sequence ends with finish_reason "error" and this message
                    seqs[i].error = f"{fn.__name__}: {type(e).__name__}: {e}"
            return ok

    @torch.no_grad()
    def commit(self, seqs, active: list) -> list:
        """Roll every Mamba layer of each active sequence back to its accepted prefix (SPEC §4.3):
        one launch for all layers and sequences. Returns per-row success."""
        if self.K == 1:  # plain decoding: every step is a full accept, the commit a no-op
            return list(active)
        st = self.step_state
        B = st.slots.shape[0]

        def commit_state(rows):
            mask = self._tensor([i in rows for i in range(B)], torch.bool)
            self.model.ops.commit_state(self.cache.ssm_state, self.cache.conv_state, self.cache.ssm_stash(B, self.K),
                                        self.cache.conv_stash(B, self.K), st.slots, st.na, mask)

        return self._isolated(commit_state, seqs, active)

    @torch.no_grad()
    def propose(self, seqs, active: list) -> list:
        """Draft the next rows of the sequences still running. Returns per-row success."""
        if not self.gamma:
            return list(active)

        def propose(rows):
            self.proposer.after_verify(self, seqs, rows)

        return self._isolated(propose, seqs, active)

    def set_drafts(self, seqs, drafts: list):
        """Host-side drafts (one list per sequence, up to γ tokens) into the per-slot buffers."""
        if not seqs:
            return
        slots = self._tensor([s.slot for s in seqs])
        padded = [d[: self.gamma] + [0] * (self.gamma - len(d[: self.gamma])) for d in drafts]
        self.drafts[slots] = self._tensor(padded)
        self.num_drafts[slots] = self._tensor([min(len(d), self.gamma) for d in drafts])
        if any(not s.params.greedy for s in seqs):  # a deterministic draft has q = one-hot
            q = torch.zeros(len(seqs), self.gamma, self.cfg.vocab_size, device=self.device)
            q.scatter_(-1, self.drafts[slots][..., None], 1.0)
            self.need_draft_probs()[slots] = q
