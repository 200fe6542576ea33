"""The scheduler loop: requests in, tokens out, speculative decoding in between.

    step() = schedule -> run -> postprocess
      schedule     admit waiting requests into free slots: prefill, first token, first drafts
      run          verify every live sequence in one batch ([last token | drafts], K rows) and judge it
      postprocess  apply each verdict (SPEC §4): emit accepted drafts then the target's pick, stopping
                   at the first finishing token; commit the Mamba states to the accepted prefix;
                   propose the next drafts; release finished slots

Everything here is host-side: lists of ints and Sequence objects. Tensors stay in
the runner; the only device-to-host copy of a step is the verdict's.
"""
from collections import deque
from dataclasses import dataclass, field

from nano_spec.sampling import SamplingParams


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
    logprobs: list = field(default_factory=list)
    verify_steps: int = 0
    verify_emitted: int = 0          # tokens emitted by verify steps (tau = verify_emitted / verify_steps)

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
        return self.verify_emitted / self.verify_steps if self.verify_steps else 0.0


class Scheduler:
    def __init__(self, runner, tokenizer, max_batch: int, max_seq_len: int, telemetry):
        self.runner, self.tok, self.tel = runner, tokenizer, telemetry
        self.max_seq_len = max_seq_len
        self.free_slots = list(range(max_batch))
        self.waiting = deque()
        self.running = []
        self.next_id = 0

    def add(self, prompt_ids: list, params: SamplingParams) -> Sequence:
        seq = Sequence(self.next_id, len(prompt_ids), list(prompt_ids), params)
        self.next_id += 1
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence):
        """Cancel a request mid-flight: it leaves the queue or the batch and its slot is freed."""
        if seq.finished:
            return
        self._finish(seq, "cancelled")
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self):
        """One engine step: admit what fits, then one speculative step for every live sequence."""
        self._schedule()
        if self.running:
            self._run_and_postprocess()

    # ---- schedule -------------------------------------------------------------------
    def _schedule(self):
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop(0)
            try:
                with self.tel.phase("prefill"):
                    result = self.runner.prefill(seq)
            except Exception as e:  # a fault in one admission ends that request only
                seq.error, result = f"prefill: {type(e).__name__}: {e}", None
            if result is None or not result.ok:
                seq.error = seq.error or "non-finite logits"
                self._finish(seq, "error")
            else:
                self._emit(seq, result.tokens[0], result.logprobs[0] if result.logprobs else None)
            if seq.finished:
                self._release(seq)
            else:
                self.running.append(seq)

    # ---- run + postprocess ----------------------------------------------------------------
    def _run_and_postprocess(self):
        batch = list(self.running)
        with self.tel.phase("verify"):
            self.runner.verify(batch)
        with self.tel.phase("verdict"):
            results = self.runner.verdict(batch)
        active = []
        for seq, r in zip(batch, results):
            if not r.ok:  # non-finite logits: this sequence ends, the others go on
                seq.error = "non-finite logits"
                self._finish(seq, "error")
            else:
                self._apply(seq, r)
            active.append(not seq.finished)
        with self.tel.phase("commit"):
            active = self._keep(batch, active, self.runner.commit(batch, active))
        if any(active):
            with self.tel.phase("propose"):
                self._keep(batch, active, self.runner.propose(batch, active))
        for seq in batch:
            if seq.finished:
                self._release(seq)
        self.running = [s for s in self.running if not s.finished]

    def _keep(self, batch, active, ok) -> list:
        """Sequences whose commit or propose failed end with an error; the others go on."""
        for seq, a, good in zip(batch, active, ok):
            if a and not good:
                self._finish(seq, "error")
        return [a and good for a, good in zip(active, ok)]

    def _apply(self, seq: Sequence, r):
        """Emit drafts[0..na) then v[na], one at a time, until one finishes the sequence."""
        seq_len, before = seq.seq_len, len(seq.tokens)
        for j, token in enumerate(r.tokens):
            self._emit(seq, token, r.logprobs[j] if r.logprobs else None)
            if seq.finished:
                break
        emitted = len(seq.tokens) - before
        seq.verify_steps += 1
        seq.verify_emitted += emitted
        self.tel.record_verify(r.na, emitted, seq_len)

    def _emit(self, seq: Sequence, token: int, logprob):
        seq.tokens.append(token)
        if seq.params.logprobs:
            seq.logprobs.append(logprob)
        p = seq.params
        if token in p.stop_token_ids or (token in self.tok.eos_ids and not p.ignore_eos):
            self._finish(seq, "stop")
        elif p.stop and self._cut_at_stop(seq):
            self._finish(seq, "stop")
        elif len(seq.generated) >= p.max_new_tokens or len(seq.tokens) >= self.max_seq_len:
            self._finish(seq, "length")

    def _cut_at_stop(self, seq: Sequence) -> bool:
        """A stop string anywhere in the generated text (it may span tokens) ends it there."""
        text = self.tok.decode(seq.generated)
        hits = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        if hits:
            seq.text = text[: min(hits)]
        return bool(hits)

    def _finish(self, seq: Sequence, reason: str):
        seq.finish_reason = reason

    def _release(self, seq: Sequence):
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def output_text(self, seq: Sequence) -> str:
        return seq.text if seq.text is not None else self.tok.decode(seq.generated)
