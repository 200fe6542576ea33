"""The scheduler loop: requests in, tokens out, speculative decoding in between.

    step() = schedule -> run -> postprocess
      schedule     admit waiting requests into free slots: prefill, first token, the drafter's catch-up
      run          one speculative step of every live sequence (ModelRunner.step, docs/DESIGN.md §4)
      postprocess  emit each sequence's accepted drafts then the target's pick, stopping at the first
                   finishing token; release finished slots

Everything here is host-side: lists of ints and Sequence objects. No tensor passes through. One fault policy: a
row the runner reports bad (non-finite logits, drafts its drafter got wrong) ends that sequence; anything a runner
call raises ends every sequence of that call.
"""
from collections import deque
from dataclasses import dataclass, field

from nano_spec.model.sampling import SamplingParams
from nano_spec.text.tokenizer import IncrementalDecoder

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
    on_finish: object = None         # called with the sequence once it has finished, under the engine's lock

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
    failed: list = field(default_factory=list)     # seq_ids a failed runner call ended (admission or step)
    rows: list = field(default_factory=list)       # StepRow per verified sequence
    phase_seconds: dict = field(default_factory=dict)


class Scheduler:
    def __init__(self, runner, tokenizer, max_seq_len: int, planner=None, threads=None):
        self.runner, self.tok, self.tel, self.planner = runner, tokenizer, runner.tel, planner
        self.threads, self.max_seq_len = threads, max_seq_len  # threads: a ThreadTuner, the CPU threads of each step
        self.free_slots = list(range(runner.cache.num_slots))
        self.waiting, self.running = deque(), []
        self.next_id = self.steps = 0

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
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release([seq])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self, focus: set | None = None) -> StepReport:
        report = StepReport(self.steps)
        self.steps += 1
        self.tel.step_seconds = {}  # phase -> seconds within this step
        if self.threads is not None:
            self.threads.apply()
        batch = self._schedule(report, focus)                                  # schedule
        if batch:
            gamma = self._gamma(batch)
            t0, spent, compiled = self.tel.clock(), self.tel.drafter_seconds(), self.runner.compile_seconds()
            results = self._call(report, batch, "step", self.runner.step, batch, gamma)  # run
            if results is not None:                                                    # postprocess
                report.rows += [self._apply(seq, r) for seq, r in zip(batch, results)]
                if self.runner.compile_seconds() == compiled:  # a step that compiled a graph is not its cost
                    self._observe(len(batch), gamma, t0, spent, results)
            self._release(batch)
        report.phase_seconds = dict(self.tel.step_seconds)
        return report

    def _schedule(self, report: StepReport, focus: set | None) -> list:
        """Admit waiting requests into free slots -> this step's batch. focus: the ids a caller waits for; the
        other sequences keep their place and slot and wait, unless none of focus can run (every slot is held by
        others): then all run, so that slots come free."""
        wanted = lambda s: focus is None or s.id in focus  # noqa: E731
        while self.free_slots:  # an admission that ends at once frees its slot again
            seq = next((s for s in self.waiting if wanted(s)), None)  # the queue is read only while a slot is free
            if seq is None:
                break
            self.waiting.remove(seq)
            self._admit(seq, report)
        return [s for s in self.running if wanted(s)] or ([] if report.admitted else list(self.running))

    def _gamma(self, batch: list) -> int:
        """γ of the step: the planner's choice, but γ_max when a seeded sampled request is in the batch. Its
        random draws follow γ, and the planner's γ follows measured times: a fixed γ keeps its seed's promise."""
        if self.planner is None or any(s.params.seed is not None and not s.params.greedy for s in batch):
            return self.runner.max_drafts
        return self.planner.choose(len(batch))

    def _observe(self, B: int, gamma: int, t0: float, spent: float, results: list):
        """The planner learns the step's time (and the drafter's share) and its accept counts; the thread
        tuner, its time."""
        seconds = self.tel.clock() - t0
        if self.planner:
            self.planner.observe_step(B, gamma, seconds, self.tel.drafter_seconds() - spent,
                                      [(r.na, len(r.drafts)) for r in results if r.error is None])
        if self.threads is not None:
            self.threads.observe((B, gamma), seconds)

    def _admit(self, seq: Sequence, report: StepReport):
        seq.slot = self.free_slots.pop(0)
        self.running.append(seq)
        r = self._call(report, [seq], "prefill", self.runner.admit, seq)
        if r is not None and r.error:
            self._end(seq, r.error)
            report.failed.append(seq.id)
        elif r is not None:
            self._emit(seq, r.tokens[0], r.logprobs[0] if r.logprobs else None, PREFILL)
            report.admitted.append((seq.id, r.tokens[0]))
        self._release([seq])

    def _call(self, report: StepReport, seqs: list, what: str, fn, *args):
        """fn(*args), a runner call on seqs. Whatever it raises belongs to no single row, and the caches of all
        of seqs are in an unknown state: each ends with an error, frees its slot and is reported failed. An
        interrupt then goes on up; an exception stays here (None is returned), so the engine serves the others."""
        try:
            return fn(*args)
        except BaseException as e:
            interrupt = not isinstance(e, Exception)
            for seq in seqs:
                self._end(seq, f"interrupted: {type(e).__name__} during {what}" if interrupt else
                          f"{what}: {type(e).__name__}: {' '.join(str(e).split())}")
            self._release(seqs)
            report.failed += [s.id for s in seqs]
            if interrupt:
                raise
            return None

    def _apply(self, seq: Sequence, r) -> StepRow:
        """Emit drafts[0..na) then v[na], one at a time, until one finishes the sequence."""
        if r.error:
            self._end(seq, r.error)
            self.tel.propose_failures += r.error.startswith("proposer")
            return StepRow(seq.id, r.drafts, r.na, [], seq.finish_reason)
        seq_len, before = seq.seq_len, len(seq.tokens)
        pick_origin = BONUS if r.na == len(r.drafts) else CORRECTION
        for j, token in enumerate(r.tokens):
            self._emit(seq, token, r.logprobs[j] if r.logprobs else None, DRAFT if j < r.na else pick_origin)
            if seq.finished:
                break
        seq.verify_steps += 1
        seq.verified_tokens += r.na + 1
        self.tel.record_verify(r.na, len(seq.tokens) - before, seq_len, seq.constraint is not None, len(r.drafts))
        return StepRow(seq.id, r.drafts, r.na, seq.tokens[before:], seq.finish_reason)

    def _end(self, seq: Sequence, error: str):
        if not seq.finished:
            seq.error, seq.finish_reason = error, "error"

    def _emit(self, seq: Sequence, token: int, logprob, origin: str):
        seq.tokens.append(token)
        seq.origins.append(origin)
        new_text = seq.decoder.add(token) if seq.params.stop else seq.decoder.push(token)  # only a stop reads it
        if seq.params.logprobs:
            seq.logprobs.append(logprob)
        p, c = seq.params, seq.constraint
        if c is not None and not c.consume(token):  # not reached: every pick and draft is made under the mask
            self._end(seq, f"grammar: {c.error}")
        elif (token in p.stop_token_ids or (token in self.tok.eos_ids and not p.ignore_eos)
              or (new_text and self._cut_at_stop(seq, len(new_text)))  # before the grammar's end: cut
              or (c is not None and c.stopped)):  # the grammar is complete: only EOS could follow
            seq.finish_reason = "stop"
        elif len(seq.tokens) - seq.prompt_len >= p.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
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

    def _release(self, seqs: list):
        """Every sequence that finishes passes here: its slot is freed and its on_finish called, once."""
        for seq in seqs:
            if seq.finished and seq.slot is not None:
                self.free_slots.append(seq.slot)
                seq.slot = None
            if seq.finished and seq.on_finish is not None:
                seq.on_finish, tell = None, seq.on_finish
                tell(seq)
        self.running = [s for s in self.running if not s.finished]

    def output_text(self, seq: Sequence) -> str:
        """The whole text once finished; while running, only complete characters."""
        return seq.text if seq.text is not None else seq.decoder.full_text() if seq.finished else seq.decoder.text
