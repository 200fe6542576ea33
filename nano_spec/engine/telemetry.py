"""Engine telemetry (docs/DESIGN.md §7): tau, accept_at overall and by seq_len bucket, and per-phase times as
running sums and fixed-size histograms (memory does not grow with the number of steps). Time comes from an
injected clock so tests can drive it.

    tau          = Σ (na + 1) / verify steps           tokens each verify produced, bonus included
    accept_at[j] = #(verify steps with na > j) / verify steps
    drafted_at[j] = #(verify steps with nd > j): steps that tried draft j + 1 (0: never tried, so
                   accept_at[j] = 0 says nothing about the drafter)
so tau = 1 + Σ_j accept_at[j] exactly. On the step where a sequence finishes it may emit fewer than na + 1 tokens;
`emitted` counts what was emitted. `constrained` holds tau and accept_at of the requests with a grammar alone.

On CUDA the phases are host times: queued GPU work is charged to the phase that waits for it (copy, the step's one
device-to-host copy).
"""
import time
from collections import defaultdict
from contextlib import contextmanager

# mask: the verify's grammar masks; catch_up: the drafter's, after a verify or over a prompt; step: the device step
# as one graph (compiled modes; eager times its parts: propose .. catch_up); copy: the step's one device-to-host copy
PHASES = ("prefill", "propose", "verify", "mask", "verdict", "commit", "catch_up", "step", "copy")
SEQ_LEN_BUCKETS = (0, 128, 512, 2048, 8192)  # lower edges
HIST_EDGES_MS = (0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000)  # upper edges; one overflow bucket


def bucket_label(seq_len: int) -> str:
    lo = max(b for b in SEQ_LEN_BUCKETS if b <= seq_len)
    hi = next((b for b in SEQ_LEN_BUCKETS if b > seq_len), None)
    return f"{lo}-{hi}" if hi else f"{lo}+"


class Tally:
    """The verify steps of some requests: their count, Σ (na + 1), and per draft j the steps with na > j."""

    def __init__(self, max_drafts: int):
        self.steps, self.verified, self.accepted_gt = 0, 0, [0] * max_drafts

    def add(self, na: int):
        self.steps += 1
        self.verified += na + 1
        for j in range(min(na, len(self.accepted_gt))):
            self.accepted_gt[j] += 1

    @property
    def accept_at(self) -> list:
        return [a / max(self.steps, 1) for a in self.accepted_gt]


class Telemetry:
    def __init__(self, max_drafts: int, clock=time.perf_counter):
        self.clock, self.max_drafts = clock, max_drafts
        self.reset()

    def reset(self):
        """Forget everything counted so far (e.g. after a warm-up run)."""
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self.phase_counts = {p: [0] * (len(HIST_EDGES_MS) + 1) for p in PHASES}
        self.step_seconds = {}                # phase -> seconds within the current engine step
        self.total, self.constrained = Tally(self.max_drafts), Tally(self.max_drafts)  # constrained: with a grammar
        self.by_bucket = defaultdict(lambda: Tally(self.max_drafts))  # seq_len bucket -> its Tally
        self.drafted_gt = [0] * self.max_drafts   # steps with nd > j
        self.emitted = 0                      # tokens emitted by verify steps
        self.propose_failures = 0             # drafting faults; those sequences went on without drafts

    @contextmanager
    def phase(self, name: str):
        t0 = self.clock()
        try:
            yield
        finally:
            seconds = self.clock() - t0
            self.phase_seconds[name] += seconds
            self.step_seconds[name] = self.step_seconds.get(name, 0.0) + seconds
            ms = seconds * 1e3
            self.phase_counts[name][next((i for i, e in enumerate(HIST_EDGES_MS) if ms <= e), len(HIST_EDGES_MS))] += 1

    def drafter_seconds(self) -> float:
        return self.phase_seconds["propose"] + self.phase_seconds["catch_up"]

    def record_verify(self, na: int, emitted: int, seq_len: int, constrained: bool = False, nd: int = 0):
        """One sequence's verdict: na accepted drafts of nd, of which `emitted` tokens were emitted."""
        for tally in (self.total, self.by_bucket[bucket_label(seq_len)]) + ((self.constrained,) if constrained else ()):
            tally.add(na)
        for j in range(min(nd, self.max_drafts)):
            self.drafted_gt[j] += 1
        self.emitted += emitted

    @property
    def accept_at(self) -> list:
        return self.total.accept_at

    def summary(self) -> dict:
        c = self.constrained
        return {
            "tau": self.total.verified / max(self.total.steps, 1),
            "accept_at": self.accept_at,
            "drafted_at": list(self.drafted_gt),
            "verify_steps": self.total.steps,
            "emitted": self.emitted,
            "propose_failures": self.propose_failures,
            "constrained": {"verify_steps": c.steps, "tau": c.verified / max(c.steps, 1), "accept_at": c.accept_at},
            "accept_at_by_seq_len": {k: {"steps": t.steps, "accept_at": t.accept_at}
                                     for k, t in sorted(self.by_bucket.items())},
            "phase_seconds": dict(self.phase_seconds),
            "phase_histogram_ms": {"edges": list(HIST_EDGES_MS), **{p: list(n) for p, n in self.phase_counts.items()}},
        }
