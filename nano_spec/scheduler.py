"""The scheduler loop: requests in, tokens out, speculative decoding in between.

    step() = schedule -> run -> postprocess
      schedule     admit waiting requests into free slots: prefill, first token, first drafts
      run          verify every live sequence in one batch ([last token | drafts], K rows) and judge it
      postprocess  apply each verdict (docs/DESIGN.md §4): emit accepted drafts then the target's pick,
                   stopping at the first finishing token; commit the Mamba states to the accepted
                   prefix; propose the next drafts; release finished slots

Everything here is host-side: lists of ints and Sequence objects. Tensors stay in
the runner; `Step` and `Verdict` pass through here as opaque handles.
"""
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

from nano_spec.sampling import SamplingParams
from nano_spec.tokenizer import IncrementalDecoder

# Where an emitted token came from (docs/DESIGN.md §1)
PREFILL, DRAFT, CORRECTION, BONUS = "prefill", "draft", "correction", "bonus"


@dataclass
class Sequence:
    id: int
    prompt_len: int
    tokens: list                     # prompt + emitted
    params: SamplingParams
    slot: int | None = None
    finish_reason: str | None = None  # "stop", "length" or "error" ("cancelled" for an aborted stream)
    error: str | None = None         # what went wrong, when finish_reason is "error"
    text: str | None = None          # set when a stop string cut the text
    decoder: object = None           # IncrementalDecoder of the generated tokens
    constraint: object = None        # grammar.Constraint of a structured-output request, over its emitted tokens
    logprobs: list = field(default_factory=list)
    origins: list = field(default_factory=list)  # per generated token: prefill, draft, correction or bonus
    verify_steps: int = 0
    verified_tokens: int = 0         # Σ (na + 1) over its verify steps (tau = verified_tokens / verify_steps)

    @property
    def seq_len(self) -> int:  # tokens whose effect is in the caches; tokens[-1] is emitted, not yet fed
        return len(self.tokens) - 1

    @property
    def generated(self) -> list:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tau(self) -> float:
        return self.verified_tokens / self.verify_steps if self.verify_steps else 0.0


@dataclass
class StepRow:
    """One sequence's part of a verify step, for tracing."""
    seq_id: int
    drafts: list             # the real drafts verified
    na: int
    emitted: list            # the tokens emitted (fewer than na + 1 when the sequence finished)
    finish_reason: str | None


@dataclass
class StepReport:
    """What one engine step did, for --trace and on_step callbacks."""
    index: int
    admitted: list = field(default_factory=list)   # (seq_id, first token)
    failed: list = field(default_factory=list)     # seq_ids whose admission failed
    rows: list = field(default_factory=list)       # StepRow per verified sequence
    phase_seconds: dict = field(default_factory=dict)


class Scheduler:
    def __init__(self, runner, tokenizer, max_batch: int, max_seq_len: int, telemetry, planner=None):
        self.runner, self.tok, self.tel, self.planner = runner, tokenizer, telemetry, planner
        self.max_seq_len = max_seq_len
        self.gamma = runner.gamma  # drafts of the coming verify: fixed, or the planner's choice
        self.free_slots = list(range(max_batch))
        self.waiting = deque()
        self.running = []
        self.next_id = 0
        self.steps = 0

    def add(self, prompt_ids: list, params: SamplingParams, constraint=None) -> Sequence:
        seq = Sequence(self.next_id, len(prompt_ids), list(prompt_ids), params, decoder=IncrementalDecoder(self.tok),
                       constraint=constraint)
        self.next_id += 1
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence):
        """Cancel a request mid-flight: it leaves the queue or the batch and its slot is freed."""
        if seq.finished:
            return
        seq.finish_reason = "cancelled"
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> StepReport:
        """One engine step: admit what fits, then one speculative step for every live sequence."""
        report = StepReport(self.steps)
        self.steps += 1
        self.tel.begin_step()
        self._schedule(report)
        if self.running:
            batch = list(self.running)
            with self._ends_on_interrupt(batch):
                self._run_batch(batch, report)
        report.phase_seconds = dict(self.tel.step_seconds)
        return report

    # ---- schedule -------------------------------------------------------------------
    def _schedule(self, report: StepReport):
        if self.planner and not self.running and self.waiting:  # a new batch: no drafts are pending yet
            self.gamma = self.planner.choose(min(len(self.waiting), len(self.free_slots)))
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            with self._ends_on_interrupt([seq]):
                self._admit(seq, report)

    def _admit(self, seq: Sequence, report: StepReport):
        try:
            with self.tel.phase("prefill"):
                adm = self.runner.prefill(seq)
        except Exception as e:  # a fault in one admission ends that request only
            seq.error, adm = f"prefill: {type(e).__name__}: {e}", None
        if adm is None or not adm.result.ok:
            seq.error, seq.finish_reason = seq.error or "non-finite logits", "error"
            report.failed.append(seq.id)
        else:
            r = adm.result
            self._emit(seq, r.tokens[0], r.logprobs[0] if r.logprobs else None, PREFILL)
            report.admitted.append((seq.id, r.tokens[0]))
        if seq.finished:
            self._release(seq)
        else:
            with self.tel.phase("propose"):
                if not self.runner.propose_first(seq, adm, self.gamma):
                    self.tel.propose_failures += 1
            self.running.append(seq)

    @contextmanager
    def _ends_on_interrupt(self, seqs: list):
        """If a step is interrupted (KeyboardInterrupt, or an exception no sequence owns), the sequences
        it was updating have caches in an unknown state: end them with an error and free their slots."""
        try:
            yield
        except BaseException as e:
            for seq in seqs:
                if not seq.finished:
                    seq.error, seq.finish_reason = f"interrupted: {type(e).__name__} during an engine step", "error"
                self._release(seq)
            self.running = [s for s in self.running if not s.finished]
            raise

    # ---- run + postprocess ----------------------------------------------------------------
    def _run_batch(self, batch: list, report: StepReport):
        gamma = self.gamma
        with self.tel.phase("verify"):
            step = self.runner.verify(batch, gamma)
        bitmask = None
        if any(s.constraint is not None for s in batch):  # host work only for batches with a grammar
            with self.tel.phase("mask"):
                bitmask = self.runner.bitmask(step, batch)
        with self.tel.phase("verdict"):
            verdict = self.runner.verdict(step, batch, bitmask)
        active = []
        for seq, r in zip(batch, verdict.rows):
            emitted = self._apply(seq, r) if r.ok else []
            if not r.ok:  # non-finite logits: this sequence ends, the others go on
                seq.error, seq.finish_reason = "non-finite logits", "error"
            report.rows.append(StepRow(seq.id, r.drafts, r.na, emitted, seq.finish_reason))
            active.append(not seq.finished)
        with self.tel.phase("commit"):
            ok, errors = self.runner.commit(step, verdict, active)
        for seq, a, good, err in zip(batch, active, ok, errors):
            if a and not good:  # a failed commit leaves a state nobody can trust: that sequence ends
                seq.error, seq.finish_reason = err, "error"
        active = [a and good for a, good in zip(active, ok)]
        if self.planner:  # this step's cost and acceptance in, the next step's γ out
            secs = sum(self.tel.step_seconds.get(p, 0.0) for p in ("verify", "mask", "verdict", "commit"))
            self.planner.observe_step(len(batch), gamma, secs, [(r.na, len(r.drafts)) for r in verdict.rows if r.ok])
            self.gamma = self.planner.choose(sum(active))
        if any(active):
            before = self.tel.step_seconds.get("propose", 0.0)
            with self.tel.phase("propose"):
                ok = self.runner.propose(batch, step, verdict, active, self.gamma)
            self.tel.propose_failures += sum(a and not good for a, good in zip(active, ok))
            if self.planner:
                self.planner.observe_propose(self.gamma, self.tel.step_seconds["propose"] - before)
        for seq in batch:
            if seq.finished:
                self._release(seq)
        self.running = [s for s in self.running if not s.finished]

    def _apply(self, seq: Sequence, r) -> list:
        """Emit drafts[0..na) then v[na], one at a time, until one finishes the sequence."""
        seq_len, before = seq.seq_len, len(seq.tokens)
        last = BONUS if r.na == len(r.drafts) else CORRECTION
        for j, token in enumerate(r.tokens):
            self._emit(seq, token, r.logprobs[j] if r.logprobs else None, DRAFT if j < r.na else last)
            if seq.finished:
                break
        seq.verify_steps += 1
        seq.verified_tokens += r.na + 1
        self.tel.record_verify(r.na, len(seq.tokens) - before, seq_len, seq.constraint is not None)
        return seq.tokens[before:]

    def _emit(self, seq: Sequence, token: int, logprob, origin: str):
        seq.tokens.append(token)
        seq.origins.append(origin)
        new_text = seq.decoder.add(token)
        if seq.params.logprobs:
            seq.logprobs.append(logprob)
        p, c = seq.params, seq.constraint
        if c is not None and not c.consume(token):  # not reached: every pick and draft is made under the mask
            seq.error, seq.finish_reason = f"grammar: {c.error}", "error"
        elif token in p.stop_token_ids or (token in self.tok.eos_ids and not p.ignore_eos):
            seq.finish_reason = "stop"
        elif c is not None and c.stopped:  # the grammar is complete: only EOS could follow
            seq.finish_reason = "stop"
        elif new_text and p.stop and self._cut_at_stop(seq, len(new_text)):
            seq.finish_reason = "stop"
        elif len(seq.generated) >= p.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
            seq.finish_reason = "length"

    def _cut_at_stop(self, seq: Sequence, n_new: int) -> bool:
        """A stop string in the generated text (it may span tokens) ends it there. Only the new text and
        the longest stop string's overlap into the old can hold a new match."""
        text = seq.decoder.text
        start = max(0, len(text) - n_new - max(map(len, seq.params.stop)) + 1)
        hits = [i for i in (text.find(s, start) for s in seq.params.stop) if i >= 0]
        if hits:
            seq.text = text[: min(hits)]
        return bool(hits)

    def _release(self, seq: Sequence):
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def output_text(self, seq: Sequence) -> str:
        """The whole text once finished; while running, only complete characters."""
        if seq.text is not None:
            return seq.text
        return seq.decoder.full_text() if seq.finished else seq.decoder.text
