"""The model runner: every tensor of the engine lives here or in the drafter, none in the scheduler.

The scheduler hands it host-side sequences (slot, tokens, params) and gets back host values: one RowResult per
sequence. It keeps the target's caches and, per slot, the sequence length, the last emitted token, the sampling
settings and the request's random generator; the drafter keeps its own state.

One step, in the order of nano_spec/reference.py (docs/DESIGN.md §4), with γ drafts per sequence and K = γ + 1 rows:
    host    random draws; a host drafter's drafts; a grammar's masks after each draft prefix
    device  (_device_step, one function; nano_spec/engine/graph.py runs it eager, compiled or as a CUDA graph)
      1. a device drafter drafts     drafts (B, γ), nd (B,)
      2. one batched verify          rows [last token | drafts] -> logits (B, K, V), stashes written
      3. the accept rule             na (B,), emitted (B, K); seq_len and the last token advance
      4. commit                      Mamba states back to row na where a draft was rejected (one launch)
      5. a device drafter catches up on the verified rows, up to row na
    host    a host drafter catches up; one device-to-host copy: the RowResults
"""
from dataclasses import dataclass

import torch

from nano_spec.model.cache import HybridCache, SlotIds, cache_len
from nano_spec.model.model import HybridLM
from nano_spec.model.sampling import BatchSampling, SamplingParams, accept_rule, token_logprobs
from nano_spec.text.grammar import verify_bitmask
from nano_spec.drafters.base import DeviceDrafter, Drafts, VerifiedRows
from nano_spec.engine.graph import PromptGraph, StepGraph, gemm_template, mode_of
from nano_spec.engine.telemetry import Telemetry


@dataclass(frozen=True)
class RowResult:
    """What the scheduler learns about one sequence from a step or an admission (host values)."""
    na: int                  # accepted drafts
    drafts: list             # the real drafts that were verified (nd = len(drafts))
    tokens: list             # emitted tokens in order: drafts[:na], then the target's pick
    logprobs: list | None    # per token: (logprob, {token: logprob} of the top-n)
    error: str | None        # the sequence ends: non-finite logits, or drafts its drafter got wrong


def pack(logits, emitted, na, drafts: Drafts):
    """(B, 4 + K + γ) long: na, nd, finite, refused, the emitted tokens, the drafts. Only rows 0..na must be
    finite: padding rows and rows past a rejection are not used."""
    unused = torch.arange(logits.shape[1], device=na.device) > na[:, None]  # (B, K)
    finite = (torch.isfinite(logits).all(-1) | unused).all(-1)  # (B,)
    refused = torch.zeros_like(na) if drafts.refused is None else drafts.refused.long()
    flags = torch.stack([na, drafts.nd, finite.long(), refused], dim=1)  # (B, 4)
    return torch.cat([flags, emitted, drafts.tokens], dim=1)


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
        # the device step in the engine's mode, one graph per bucket: (batch, KV rows) and the step's kind, of which
        # there are 6 a γ: greedy, sampled or filtered, each with a grammar's mask or without
        self.graph = StepGraph(self._device_step, mode_of(compile, self.device), self.model.ops,
                               lambda name: self.tel.phase(name),  # looked up per call: a profiler may wrap it
                               num_slots, self.cache.k.shape[2], per_bucket=6 * (self.max_drafts + 1),
                               template=gemm_template(sum(p.numel() * p.element_size() for p in model.parameters())),
                               nets=(self.model,), drafts=drafter.nets if self.device_drafter else ())
        self.prompt = PromptGraph(self.model.prompt_layer, self.graph.mode)  # a prompt's layers in the same mode
        self.generators = [None] * num_slots
        # per-slot device copies, written at admission and advanced on the device after each accept rule,
        # so a step uploads nothing but the batch's slot ids (and those only when the batch changes)
        self.seq_lens = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # (S,)
        self.last = torch.zeros(num_slots, dtype=torch.long, device=self.device)      # (S,) last emitted token
        self.sampling = BatchSampling.of([SamplingParams()] * num_slots, self.device)
        no_tokens, no_nd = (torch.zeros(num_slots, 0, dtype=torch.long, device=self.device),
                            torch.zeros(num_slots, dtype=torch.long, device=self.device))
        # no drafts for B rows, what a γ = 0 step and an admission verify: made once per B (a host op costs
        # microseconds next to a step's graph, which has just pushed torch's code out of the CPU's caches)
        self.no_drafts = [Drafts(no_tokens[:B], no_nd[:B], None) for B in range(num_slots + 1)]

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
            hidden = self.model.prefill(ids, seq.slot, self.cache, tapped, self.prompt)  # (T, D)
            logits = self.model.logits(hidden[-1:])  # (1, V)
            sampling = BatchSampling.of([seq.params], self.device)
            self.sampling.write(seq.slot, sampling)
            mask = None if seq.constraint is None else seq.constraint.mask()[None].to(self.device)  # (1, Vw)
            u = self._uniforms([seq], 1, sampling.all_greedy)
            first, _ = sampling.pick(logits, None if u is None else u[:, 0], mask)  # draw "first token"
            self.seq_lens[seq.slot], self.last[seq.slot] = len(seq.tokens), first[0]
        if self.max_drafts:
            with self.tel.phase("catch_up"):
                self.drafter.admit(seq, hidden, first, tapped)
        logits, emitted, none = logits[:, None], first[:, None], self.no_drafts[1]  # (1, 1, V), (1, 1)
        return self._results(logits, emitted, pack(logits, emitted, none.nd, none), [seq])[0]

    @torch.no_grad()
    def step(self, seqs, gamma: int) -> list:
        """Host work (random draws, a host drafter's drafts, a grammar's masks), then the device step in the
        engine's mode (one graph), then the step's one device-to-host copy. A batch with a grammar drafts here,
        eager (each pick waits for the host's mask after the drafts before it), and hands the graph its drafts
        and the verify's mask."""
        B, K, phase = len(seqs), gamma + 1, self.tel.phase
        slots = self.slot_ids(seqs)
        all_greedy = all(s.params.greedy for s in seqs)
        filtered = any(s.params.filters for s in seqs)  # a sort over V only where a row needs one
        constrained = any(s.constraint is not None for s in seqs)
        in_step = gamma > 0 and self.device_drafter and not constrained  # the drafter drafts inside the step
        u_draft = self._uniforms(seqs, gamma, all_greedy)  # draw "drafts"
        u_verdict = self._uniforms(seqs, K, all_greedy)    # draw "verdict"
        drafts, bitmask = self.no_drafts[B], None
        if gamma and not in_step:
            with phase("propose"):
                drafts = self.drafter.draft(seqs, gamma, u_draft)
        if constrained:  # host work only for batches with a grammar
            with phase("mask"):
                bitmask = verify_bitmask([s.constraint for s in seqs], drafts.tokens, drafts.nd)  # (B, K, Vw)
        given = () if in_step else (drafts.tokens, drafts.nd, drafts.probs, drafts.refused)
        (logits, emitted, na, packed), Bp = self.graph(
            slots, u_draft, u_verdict, bitmask, *given or (None,) * 4, kv_len=max(s.seq_len for s in seqs) + K,
            gamma=gamma, all_greedy=all_greedy, filtered=filtered, in_step=in_step)
        if self.max_drafts and not self.device_drafter:  # a host drafter follows every step, γ = 0 ones too
            with phase("catch_up"):
                before = self.seq_lens[slots] - na - 1  # (B,) the lengths before the step
                self.drafter.catch_up(seqs, self._verified(slots, before, emitted, Bp, K), na)
        with phase("copy"):
            return self._results(logits, emitted, packed, seqs)

    def _device_step(self, slots, u_draft, u_verdict, bitmask, tokens, nd, probs, refused, *, kv: int, gamma: int,
                     all_greedy: bool, filtered: bool, in_step: bool, phase):
        """The device part of a step (docs/DESIGN.md §4), one function over buffers allocated once and the inputs
        above, batch-first: slots (B,), uniforms (B, γ) and (B, K) or None, bitmask (B, K, Vw) or None, and a host
        drafter's drafts (tokens (B, γ), nd (B,), probs (B, γ, V) or None, refused (B,) or None) unless in_step.
        kv: the KV rows attention reads; phase(name): a context that times a part (a no-op inside a graph).
        Returns logits (B, K, V), emitted (B, K), na (B,) and packed (B, 4 + K + γ) for the step's one copy (pack)."""
        K, ops, B, c = gamma + 1, self.model.ops, len(slots), self.cache
        sampling = self.sampling.select(slots, all_greedy, filtered)
        with phase("propose"):  # 1. drafts: the drafter's (inside the step), or the host's
            drafts = self.drafter.draft_rows(slots, gamma, sampling, u_draft, kv) if in_step else \
                Drafts(tokens, nd, probs, refused)
        with phase("verify"):  # 2. one batched verify of rows [last token | drafts]; stashes written at (B, K)
            seq_lens = self.seq_lens[slots]  # (B,)
            rows = torch.cat([self.last[slots, None], drafts.tokens], dim=1)  # (B, K)
            logits = self.model.verify(rows, slots, seq_lens, c, kv)  # (B, K, V)
        with phase("verdict"):  # 3. the accept rule; q one-hot where a sampled row's drafts were deterministic
            q = drafts.probs if all_greedy or drafts.probs is not None else logits.new_zeros(
                *drafts.tokens.shape, self.cfg.vocab_size, dtype=torch.float32).scatter_(
                -1, drafts.tokens[..., None], 1.0)  # (B, γ, V); F.one_hot would check the ids with a host sync
            na, emitted = accept_rule(ops, logits, drafts.tokens, drafts.nd, sampling, q, u_verdict, bitmask)
            self.seq_lens[slots] = seq_lens + na + 1
            self.last[slots] = emitted.gather(1, na[:, None])[:, 0]
            packed = pack(logits, emitted, na, drafts)  # what the host learns, for the step's one copy
        if gamma:  # 4. Mamba states back to row na where a draft was rejected (a full accept leaves them right)
            with phase("commit"):
                ops.commit_state(c.ssm_state, c.conv_state, c.ssm_stash(B, K), c.conv_stash(B, K), slots, na,
                                 na < gamma)
        if self.max_drafts and self.device_drafter:  # 5. a device drafter catches up, γ = 0 steps too
            with phase("catch_up"):
                self.drafter.catch_up_rows(self._verified(slots, seq_lens, emitted, B, K), na, kv)
        return logits, emitted, na, packed

    @property
    def device_drafter(self) -> bool:
        """The drafter drafts and catches up inside the step (read per step: a test may swap the drafter)."""
        return isinstance(self.drafter, DeviceDrafter)

    def compiled_calls(self) -> list:
        """The calls that make graphs in the engine's mode: the step's, and a compiled engine's prompts'."""
        return {"eager": [], "compiled": [self.graph, self.prompt], "cuda_graph": [self.graph]}[self.graph.mode]

    def compile_seconds(self) -> float:
        """Time spent making graphs (compiling, loading from the on-disk cache, or capturing)."""
        return sum(self.compile_seconds_by_call().values())

    def compile_seconds_by_call(self) -> dict:
        """compile_seconds by call ("step", "prompt"): each is spent inside its own phase (step, prefill)."""
        return {c.label: c.seconds for c in self.compiled_calls()}

    # ---- helpers -------------------------------------------------------------------
    def _uniforms(self, seqs, n: int, all_greedy: bool):
        """(B, n) uniforms, each row from its sequence's own generator (reproducible per request); None when
        every row is greedy or n is 0."""
        if all_greedy or not n:
            return None
        return torch.stack([torch.rand(n, generator=self.generators[s.slot], device=self.device) for s in seqs])

    def _verified(self, slots, seq_lens, emitted, Bp: int, K: int) -> VerifiedRows:
        """The step's verified rows for a drafter's catch-up; the stashes were written at (Bp, K)."""
        B = len(slots)
        return VerifiedRows(slots, seq_lens, emitted, self.cache.hidden_stash(Bp, K)[:B],
                            self.cache.tap_stash(Bp, K)[:B] if self.taps else None)

    def _results(self, logits, emitted, packed, seqs) -> list:
        """The step's one device-to-host copy: the packed rows (pack) and, if asked, the logprobs."""
        packed = packed.tolist()
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
