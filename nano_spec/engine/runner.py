"""The model runner: every tensor of the engine lives here or in the drafter, none in the scheduler.

The scheduler hands it host-side sequences (slot, tokens, params) and gets back host values: one RowResult per
sequence. It keeps the target's caches and, per slot, the sequence length, the last emitted token, the sampling
settings and the request's random generator; the drafter keeps its own state.

One step, in the order of nano_spec/reference.py (docs/DESIGN.md §4), with γ drafts per sequence and K = γ + 1 rows:
    1. the drafter drafts             drafts (B, γ), nd (B,)
    2. one batched verify            rows [last token | drafts] -> logits (B, K, V), stashes written
    3. grammar masks                 the constrained rows' masks after each draft prefix
    4. the accept rule               na (B,), emitted (B, K)
    5. commit                        Mamba states back to row na where a draft was rejected (one launch)
    6. the drafter catches up         on the verified rows, up to row na
    7. one device-to-host copy       the RowResults
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nano_spec.model.cache import HybridCache, SlotIds, cache_len
from nano_spec.model.compiled import CompiledAcceptRule, Timed, compiled_verify
from nano_spec.text.grammar import verify_bitmask
from nano_spec.model.model import HybridLM
from nano_spec.drafters.base import Drafts, VerifiedRows
from nano_spec.model.sampling import BatchSampling, SamplingParams, accept_rule, token_logprobs
from nano_spec.engine.telemetry import Telemetry


@dataclass(frozen=True)
class RowResult:
    """What the scheduler learns about one sequence from a step or an admission (host values)."""
    na: int                  # accepted drafts
    drafts: list             # the real drafts that were verified (nd = len(drafts))
    tokens: list             # emitted tokens in order: drafts[:na], then the target's pick
    logprobs: list | None    # per token: (logprob, {token: logprob} of the top-n)
    error: str | None        # the sequence ends: non-finite logits, or drafts its drafter got wrong


class ModelRunner:
    def __init__(self, model: HybridLM, drafter, num_slots: int, max_seq_len: int, telemetry: Telemetry = None,
                 compile: bool = False):
        self.model, self.drafter = model.for_inference(), drafter
        self.cfg, self.max_drafts = model.cfg, drafter.max_drafts
        self.tel = telemetry or Telemetry(self.max_drafts)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.taps = list(drafter.taps)  # layers whose rows the drafter reads (a block drafter)
        self.cache = HybridCache(self.cfg, num_slots, cache_len(max_seq_len, self.max_drafts), self.max_drafts + 1,
                                 self.device, self.dtype, self.taps)
        self.slot_ids = SlotIds(self.device)
        self.compiled = compiled_verify(self.model, self.cache) if compile else None
        # the accept rule is ~10 small ops: compiled it pays on CUDA (one graph replay), not on the CPU, where
        # the compiled call's own overhead is more than its ops cost (docs/DESIGN.md §12)
        self.accept_rule = CompiledAcceptRule(self.device) if compile and self.device.type == "cuda" else accept_rule
        if compile and hasattr(self.drafter, "compile"):  # its drafting calls, bucketed alike
            self.drafter.compile()
        self.generators = [None] * num_slots
        # per-slot device copies, written at admission and advanced on the device after each accept rule,
        # so a step uploads nothing but the batch's slot ids (and those only when the batch changes)
        self.seq_lens = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # (S,)
        self.last = torch.zeros(num_slots, dtype=torch.long, device=self.device)      # (S,) last emitted token
        self.sampling = BatchSampling.of([SamplingParams()] * num_slots, self.device)
        self.no_drafts = Drafts(torch.zeros(num_slots, 0, dtype=torch.long, device=self.device),  # γ = 0 steps
                                torch.zeros(num_slots, dtype=torch.long, device=self.device), None)

    @torch.no_grad()
    def admit(self, seq) -> RowResult:
        """Prefill a new sequence into its (reset) slot, pick its first token, and let the drafter catch up
        over the prompt rows. The first step then drafts like any other."""
        with self.tel.phase("prefill"):
            self.cache.reset_slot(seq.slot)
            seed = seq.params.seed if seq.params.seed is not None else int(torch.randint(2**62, ()))
            self.generators[seq.slot] = torch.Generator(device=self.device).manual_seed(seed)
            ids = torch.tensor(seq.tokens, device=self.device)
            tapped = ids.new_empty(len(ids), len(self.taps) * self.cfg.hidden_size, dtype=self.dtype) if self.taps \
                else None  # (T, nT*D)
            hidden = self.model.prefill(ids, seq.slot, self.cache, tapped)  # (T, D)
            logits = self.model.logits(hidden[-1:])  # (1, V)
            sampling = BatchSampling.of([seq.params], self.device)
            self.sampling.write(seq.slot, sampling)
            mask = None if seq.constraint is None else seq.constraint.mask()[None].to(self.device)  # (1, Vw)
            first, _ = sampling.pick(logits, self._uniforms([seq], 1, sampling, 0), mask)  # draw "first token"
            self.seq_lens[seq.slot], self.last[seq.slot] = len(seq.tokens), first[0]
        if self.max_drafts:
            with self.tel.phase("catch_up"):
                self.drafter.admit(seq, hidden, first, tapped)
        none = self._no_drafts(1)
        return self._results(logits[:, None], first[:, None], none.nd, none, [seq])[0]

    @torch.no_grad()
    def step(self, seqs, gamma: int) -> list:
        B, K, phase = len(seqs), gamma + 1, self.tel.phase
        slots = self.slot_ids(seqs)
        sampling = self.sampling.select(slots, all(s.params.greedy for s in seqs))
        drafts = self._no_drafts(B)
        if gamma:
            with phase("propose"):
                u = self._uniforms(seqs, gamma, sampling)  # draw "drafts"
                drafts = self.drafter.draft(seqs, gamma, u)
        with phase("verify"):
            seq_lens = self.seq_lens[slots]
            rows = torch.cat([self.last[slots, None], drafts.tokens], dim=1) if gamma else self.last[slots, None]
            kv_len = max(s.seq_len for s in seqs) + K
            if self.compiled is None:
                logits, Bp = self.model.verify(rows, slots, seq_lens, self.cache, kv_len), B
            else:
                logits, Bp = self.compiled(rows, slots, seq_lens, self.cache, kv_len=kv_len)  # stashes at Bp rows
        bitmask = None
        if any(s.constraint is not None for s in seqs):  # host work only for batches with a grammar
            with phase("mask"):
                bitmask = verify_bitmask([s.constraint for s in seqs], drafts.tokens, drafts.nd)  # (B, K, Vw)
        with phase("verdict"):
            u = self._uniforms(seqs, K, sampling)  # draw "verdict"
            q = drafts.probs if sampling.all_greedy or drafts.probs is not None else \
                F.one_hot(drafts.tokens, self.cfg.vocab_size).to(torch.float32)  # (B, γ, V); one-hot: deterministic
            na, emitted = self.accept_rule(self.model.ops, logits, drafts.tokens, drafts.nd, sampling, q, u, bitmask)
            self.seq_lens[slots] = seq_lens + na + 1
            self.last[slots] = emitted.gather(1, na[:, None])[:, 0]
        if gamma:  # a full accept leaves the live state right; with γ = 0 every row is one
            with phase("commit"):
                c = self.cache
                self.model.ops.commit_state(c.ssm_state, c.conv_state, c.ssm_stash(Bp, K)[:, :B],
                                            c.conv_stash(Bp, K)[:, :B], slots, na, na < gamma)
        if self.max_drafts:  # a drafter that drafts follows every step, γ = 0 ones too
            with phase("catch_up"):
                verified = VerifiedRows(slots, seq_lens, emitted, self.cache.hidden_stash(B, K),
                                        self.cache.tap_stash(B, K) if self.taps else None)
                self.drafter.catch_up(seqs, verified, na)
        with phase("copy"):
            return self._results(logits, emitted, na, drafts, seqs)

    def compiled_calls(self) -> list:
        """This engine's compiled calls (none when eager), each Timed."""
        parts = [self.compiled, self.accept_rule, getattr(self.drafter, "compiled", None)]
        parts = [x for p in parts for x in (p.values() if isinstance(p, dict) else [p])]
        return [p for p in parts if isinstance(p, Timed)]

    def compile_seconds(self) -> float:
        """Time spent compiling (or loading from the on-disk cache) the graphs of this engine's compiled calls."""
        return sum(p.seconds for p in self.compiled_calls())

    # ---- helpers -------------------------------------------------------------------
    def _no_drafts(self, B: int) -> Drafts:
        """No drafts for B rows: what a γ = 0 step and an admission verify."""
        return Drafts(self.no_drafts.tokens[:B], self.no_drafts.nd[:B], None)

    def _uniforms(self, seqs, n: int, sampling: BatchSampling, column: int | None = None):
        """(B, n) uniforms, each row from its sequence's own generator (reproducible per request); None when
        every row is greedy or n is 0. column: that column only, (B,)."""
        if sampling.all_greedy or not n:
            return None
        u = torch.stack([torch.rand(n, generator=self.generators[s.slot], device=self.device) for s in seqs])
        return u if column is None else u[:, column]

    def _results(self, logits, emitted, na, drafts: Drafts, seqs) -> list:
        """The step's one device-to-host copy: na, nd, finiteness, refusals, emitted tokens, drafts (and the
        logprobs, if asked)."""
        # only rows 0..na are used (padding rows and rows past a rejection are not): only they must be finite
        unused = torch.arange(logits.shape[1], device=logits.device) > na[:, None]  # (B, K)
        finite = (torch.isfinite(logits).all(-1) | unused).all(-1)  # (B,)
        refused = self.no_drafts.nd[: len(seqs)] if drafts.refused is None else drafts.refused  # (B,)
        flags = torch.stack([na, drafts.nd, finite, refused], dim=1)  # (B, 4) long
        packed = torch.cat([flags, emitted, drafts.tokens], dim=1).tolist()
        top_n = max(s.params.logprobs for s in seqs)
        if top_n:  # chosen (B, K), top values and ids (B, K, n) as host lists
            chosen, top_v, top_i = (t.tolist() for t in token_logprobs(logits, emitted, top_n))
        K, out = emitted.shape[1], []
        for b, (row, s) in enumerate(zip(packed, seqs)):
            n, nd, ok, bad, k = *row[:4], s.params.logprobs
            lp = [(chosen[b][j], dict(zip(top_i[b][j][:k], top_v[b][j][:k]))) for j in range(n + 1)] if k else None
            error = "proposer: draft ids outside [0, vocab_size)" if bad else None if ok else "non-finite logits"
            out.append(RowResult(na=n, drafts=row[4 + K : 4 + K + nd], tokens=row[4 : 5 + n], logprobs=lp, error=error))
        return out
