"""The Python API: LLM (generate, stream and their chat forms, from any thread) and Output, one request's."""
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from nano_spec.drafters.factory import make_drafter
from nano_spec.engine import capacity
from nano_spec.engine.planner import DraftPlanner, block_budgets
from nano_spec.engine.runner import ModelRunner
from nano_spec.model.sampling import SamplingParams
from nano_spec.engine.scheduler import Scheduler
from nano_spec.engine.settings import EngineConfig
from nano_spec.engine.telemetry import Telemetry
from nano_spec.engine.threads import ThreadTuner, default_threads
from nano_spec.model.config import is_int
from nano_spec.model.model import load_model
from nano_spec.text.chat import ChatTemplate, conversations
from nano_spec.text.grammar import Grammars
from nano_spec.text.tokenizer import Tokenizer


@dataclass
class Output:
    prompt: str | list
    text: str
    token_ids: list
    finish_reason: str               # "stop", "length" or "error"
    logprobs: list | None            # per token, its log-probability under the target
    top_logprobs: list | None        # per token, {token_id: logprob} of the top-n
    tau: float                       # tokens per verify step for this request (docs/DESIGN.md §7)
    origins: list                    # per token: "prefill", "draft", "correction" or "bonus" (DESIGN §1)
    error: str | None = None         # what failed, when finish_reason is "error"


class LLM:
    """The engine. Its arguments are checked and resolved once, into `self.config` (nano_spec/engine/settings.py):

    model         a checkpoint directory, or a Hugging Face model id ("org/name") from the local cache or
                  downloaded (nano_spec/model/hub.py; a directory of that name wins); None: the shipped weights
    proposer      the drafter: "auto", "mtp", "dflash", "ngram", "none", or an object with max_drafts, admit(),
                  draft() and catch_up() (nano_spec/drafters/base.py)
    num_drafts    γ for every step, or "auto": γ chosen per step (nano_spec/engine/planner.py) up to
                  max_drafts = 4 (a DFlash block's Bk - 1)
    drafter       the DFlash drafter's directory for proposer="dflash"; None: <checkpoint>/dflash/
    threads       torch's intra-op threads, process-wide; None: one for a step too small to split, else chosen
                  from measured steps (nano_spec/engine/threads.py), so busy cores do not stall the engine
    compile       the device part of each step as one graph per shape bucket: torch.compile on the CPU (backend
                  'torch'), a CUDA graph around the Triton kernels on CUDA (nano_spec/engine/graph.py, DESIGN §12)
    on_step       called with a StepReport after every engine step
    backend, device, dtype, max_batch, max_seq_len, memory_budget: as named (None: chosen to fit)

    Several threads may use one LLM at once (docs/DESIGN.md §4, "Several callers")."""

    def __init__(self, model=None, backend: str = "auto", device: str = "auto", dtype=None, max_batch: int = 8,
                 num_drafts: int | str = "auto", proposer="auto", max_seq_len: int | None = None,
                 memory_budget: int | None = None, threads: int | None = None, clock=time.perf_counter,
                 on_step=None, compile: bool = False, drafter=None):
        c, self.cache_bytes = capacity.fit(EngineConfig.resolve(
            model, backend, device, dtype, max_batch, num_drafts, proposer, max_seq_len, memory_budget, threads,
            compile, drafter))
        self.config = c
        self.tokenizer = Tokenizer(c.path, c.cfg)  # checked before the weights are read
        self.chat_template = ChatTemplate(c.path)
        self.grammars = Grammars(c.path / "tokenizer.json", c.cfg.vocab_size, self.tokenizer.eos_ids)
        self.model = load_model(c.path, device=c.device, dtype=c.dtype, backend=c.backend)
        # threads=None on a CPU: measured per step (nano_spec/engine/threads.py), where a step is big enough to split
        most = c.threads or default_threads(self.model, c.max_batch, c.device)
        self.threads = ThreadTuner(most, tune=c.threads is None and c.device.type == "cpu")
        self.threads.apply()
        self.drafter = make_drafter(c, self.model)
        self.telemetry = Telemetry(c.max_drafts, clock)
        self.runner = ModelRunner(self.model, self.drafter, c.max_batch, c.max_seq_len, self.telemetry, c.compile)
        # the prior cost of a draft, relative to a plain step: extra verify rows are far from free on a CPU
        self.planner = DraftPlanner(c.max_drafts, prior_slope=0.1 if c.device.type == "cuda" else 0.4,
                                    budgets=block_budgets(c.max_drafts) if c.dflash else None) if c.auto else None
        self.scheduler = Scheduler(self.runner, self.tokenizer, c.max_seq_len, self.planner, self.threads)
        self.on_step = on_step
        self._lock, self._owner, self._callers, self._cancelled = threading.Lock(), None, {}, deque()

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    @property
    def memory_budget(self) -> int:
        return self.config.memory_budget

    def watch_compile(self, listener):
        """listener(what, n, most, threads) before each graph of the step is made: the call ("step"), its nth
        graph at this CPU thread count, the most graphs its buckets allow, and the thread count (inductor
        compiles for one). A no-op when eager."""
        for call in self.runner.compiled_calls():
            call.listener = listener

    # ---- driving the engine from any number of threads --------------------------------------------
    @contextmanager
    def _locked(self):
        """The engine's state (scheduler, caches, telemetry) is touched only under one lock. User callbacks run
        outside it, so they may call the engine again."""
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    def _run(self, done, focus: set | None, finished=None):
        """Step the engine until done(). Every caller waiting meanwhile, in any thread, shares the steps: the
        batch is the union of their focus (the ids each waits for; None: every running request)."""
        key = object()
        with self._locked():
            self._callers[key] = focus
        try:
            while True:
                with self._locked():
                    while self._cancelled:
                        self.scheduler.abort(self._cancelled.popleft())
                    report = None if done() else self._step_locked()
                if finished is not None:  # what finished is handed over before on_step reports the step
                    finished()
                if report is None:
                    return
                if self.on_step is not None:
                    self.on_step(report)
        finally:
            with self._locked():
                del self._callers[key]

    def _step_locked(self):
        focuses = list(self._callers.values())
        focus = None if None in focuses else focuses[0] if len(focuses) == 1 else set().union(*focuses)
        report = self.scheduler.step(focus)
        if not (report.admitted or report.rows or report.failed):
            raise RuntimeError(f"engine step {report.index} made no progress ({len(self.scheduler.waiting)} waiting, "
                               f"{len(self.scheduler.running)} running, {len(self.scheduler.free_slots)} free slots)")
        return report

    def _cancel(self, seq):
        """Cancel a request from any thread. A finalizer may run while this thread holds the lock (mid-step):
        then the next step cancels it."""
        if self._owner == threading.get_ident():
            self._cancelled.append(seq)
        else:
            with self._locked():
                self.scheduler.abort(seq)

    # ---- requests --------------------------------------------------------------------
    def _prepare(self, prompt, params):
        """Validate one request -> (token ids, params, grammar constraint or None); nothing is queued yet."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(map(is_int, prompt)):
            ids = list(prompt)
            if any(not 0 <= t < self.model.cfg.vocab_size for t in ids):
                raise ValueError(f"prompt: token ids must lie in [0, {self.model.cfg.vocab_size})")
        else:
            raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within max_seq_len "
                             f"{self.max_seq_len}")
        return ids, params, self.grammars.constraint(params)

    def _output(self, prompt, seq) -> Output:
        lps = seq.logprobs if seq.params.logprobs else None
        return Output(prompt=prompt, text=self.scheduler.output_text(seq), token_ids=seq.generated,
                      finish_reason=seq.finish_reason, tau=seq.tau, origins=list(seq.origins),
                      logprobs=None if lps is None else [lp for lp, _ in lps],
                      top_logprobs=None if lps is None else [top for _, top in lps],
                      error=seq.error)

    def generate(self, prompts, params=None, on_finish=None) -> list:
        """Complete each prompt (a string, a list of token ids, or a list of either); params may be one
        SamplingParams for all or a list, one per prompt. Returns one Output per prompt, in order.
        on_finish(i, output) is called as request i finishes, so a caller keeps what finished before an
        interrupt. If it is interrupted (KeyboardInterrupt or any exception), its requests are cancelled."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        if not single and not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts: expected a string, a list of token ids or a list of prompts, "
                             f"got {type(prompts).__name__}")
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        ended, told = [], 0  # the requests' indices as they finish (appended under the lock); how many were told
        with self._locked():
            requests = [self._prepare(p, sp) for p, sp in zip(prompts, plist)]  # all validated before any is queued
            seqs = [self.scheduler.add(*r) for r in requests]
            for i, seq in enumerate(seqs):  # a step then costs the same however many requests wait
                seq.on_finish = lambda _, i=i: ended.append(i)

        def finished():
            nonlocal told
            while told < len(ended):
                i, told = ended[told], told + 1
                if on_finish is not None:
                    with self._locked():
                        out = self._output(prompts[i], seqs[i])
                    on_finish(i, out)

        try:  # only these run (and those of callers in other threads): a stream nobody reads waits
            self._run(lambda: len(ended) == len(seqs), {s.id for s in seqs}, finished)
        finally:  # an interrupted call leaves nothing of its own running
            with self._locked():
                for s in seqs:
                    self.scheduler.abort(s)
        with self._locked():
            return [self._output(p, s) for p, s in zip(prompts, seqs)]

    def stream(self, prompt, params=None) -> "Stream":
        """Iterate over the completion of one prompt as text pieces, as soon as they are final; the
        pieces always add up to the whole text, however and whenever the request finished. The request
        is validated now and queued on the first read; closing the stream, or dropping it, cancels the
        request and frees its slot. `.output` is its Output once done."""
        with self._locked():
            return Stream(self, prompt, self._prepare(prompt, params))

    def chat(self, messages, params=None, on_finish=None) -> list:
        """Reply to one conversation, [{"role": ..., "content": ...}, ...], or to each of a list of them (params:
        one SamplingParams or one per conversation; on_finish as for generate). The checkpoint's chat template
        renders each with the assistant's turn opened; its end-of-turn token stops the reply. Returns one
        Output per conversation, its prompt the rendered text."""
        return self.generate(self._chat_prompts(messages), params, on_finish)

    def chat_stream(self, messages, params=None) -> "Stream":
        """The reply to one conversation as a Stream of text pieces (see stream and chat)."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple)):
            raise ValueError("messages: chat_stream takes one conversation; use chat for a list of them")
        return self.stream(self._chat_prompts(messages), params)

    def _chat_prompts(self, messages):
        """The rendered prompt of one conversation, or a list of them; all validated before any is rendered."""
        convs, single = conversations(messages)
        prompts = [self.chat_template.render(c) for c in convs]
        return prompts[0] if single else prompts

    @property
    def stats(self) -> dict:
        """Telemetry since the engine started (metrics of docs/DESIGN.md §7), and the memory settings."""
        with self._locked():
            return {**self.telemetry.summary(), **(self.planner.summary() if self.planner else {}),
                    "grammar_compile_seconds": self.grammars.compile_seconds,
                    "grammars_compiled": self.grammars.num_compiled, "compile_seconds": self.runner.compile_seconds(),
                    "compile_seconds_by_call": self.runner.compile_seconds_by_call(),
                    "threads": dict(sorted(self.threads.steps.items())), "max_seq_len": self.max_seq_len,
                    "memory_bytes": self.cache_bytes, "memory_budget": self.memory_budget}


class Stream(Iterator):
    """The text pieces of one request (LLM.stream). Reading it steps every running request (they share
    the batch), so other streams advance too; generate() calls meanwhile run only their own requests,
    unless other threads are reading streams at the same time."""

    def __init__(self, llm: LLM, prompt, request):
        self._state = {"seq": None, "output": None}  # shared with the generator, which must not hold self
        self._pieces = _pieces(llm, prompt, request, self._state)
        weakref.finalize(self, _cancel, llm, self._state)

    @property
    def output(self):
        return self._state["output"]

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self):
        self._pieces.close()


def _cancel(llm, state):
    if state["seq"] is not None:
        llm._cancel(state["seq"])


def _pieces(llm: LLM, prompt, request, state):
    sched = llm.scheduler
    with llm._locked():
        seq = state["seq"] = sched.add(*request)
    hold = max((len(s) for s in seq.params.stop), default=1) - 1  # a stop string may be forming
    sent = 0
    try:
        while True:
            with llm._locked():
                done, text, n = seq.finished, sched.output_text(seq), len(seq.tokens)
            end = len(text) if done else len(text) - hold  # while running, text has whole characters only
            if end > sent:
                yield text[sent:end]  # while suspended, other calls may advance or finish it
                sent = end
            elif done:
                break
            else:
                llm._run(lambda: seq.finished or len(seq.tokens) != n, None)
        with llm._locked():
            state["output"] = llm._output(prompt, seq)
    finally:
        llm._cancel(seq)
