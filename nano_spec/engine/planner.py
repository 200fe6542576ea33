"""Adaptive draft length (`num_drafts="auto"`): each step picks γ_eff in [0, γ_max] for the batch.

Speculation pays when the tokens a step yields grow faster than its cost. Both are measured online
(docs/DESIGN.md §4, "Draft length per step"; the metrics in §7):

    a_j      conditional acceptance: P(draft j accepted | drafts 1..j-1 were), decayed counts
    E(γ)   = 1 + Σ_{i≤γ} Π_{j≤i} a_j            expected tokens of a step with γ drafts
    t_B(γ)   seconds of a step at batch size B with γ drafts (drafting, verify, accept rule, commit, catch-up):
             a decayed mean of the steps measured at (B, γ), shrunk towards a line c0 + c1 γ fitted by decayed
             least squares over all γ ≥ 1 (a prior slope until two γ are measured), which also covers the γ
             not measured yet
    γ_eff  = argmax_γ E(γ) / t_B(γ)             predicted speedup = E(γ_eff) t_B(0) / t_B(γ_eff)

γ ranges over the drafter's budgets: every γ in 0..γ_max, or for a block drafter (one forward drafts the whole
block, whatever γ) only 0, 1, 3, 7, .. and γ_max (`block_budgets`): each γ is another verify shape, so another
kernel specialisation or graph, and a probe that costs a step. Every PROBE-th step is a probe's turn: a neighbour
of the best γ (the one below, the one above, then γ = 0, in turn) runs instead, so the costs around the choice stay
measured; but one predicted more than MARGIN behind the best runs only once it has gone STALE steps unmeasured.
A probe also costs a switch: its step runs another graph and the next one comes back (0.2-0.5 ms a switch on a
CPU, docs/BENCHMARKS.md "Auto's probes"), so a choice won by a margin is checked now and then, not every few
steps. Output does not depend on γ: every choice is lossless. Plain host arithmetic; no tensors.
"""
from collections import Counter
from itertools import accumulate
from operator import mul

PROBE = 6                    # one step in PROBE is a probe's turn (γ*-1, γ*+1, then 0, in turn)
MARGIN = 0.1                 # a probe predicted within MARGIN of γ*'s speedup runs at each of its turns;
STALE = 96                   # one further behind, once STALE steps have passed since its γ was measured
PRIOR_ACCEPT = (0.8, 0.75)   # a_1, then a_j for j > 1, as PRIOR_WEIGHT pseudo-trials
PRIOR_WEIGHT = 4.0
MIN_SECONDS = 1e-9           # the floor of a measured step: costs divide speedups


class Decayed:
    """A mean that forgets: after n observations it is exact, later ones weigh `keep`^age."""

    def __init__(self, keep: float):
        self.keep, self.w, self.mean = keep, 0.0, 0.0

    def add(self, x: float):
        self.w = self.keep * self.w + 1.0
        self.mean += (x - self.mean) / self.w


def block_budgets(max_drafts: int) -> list:
    """γ = 0, then K = γ + 1 doubling (1, 3, 7, ..), then γ_max: the budgets a block drafter's planner picks from."""
    return sorted({0, max_drafts} | {2 ** k - 1 for k in range(1, max_drafts.bit_length())})


class DraftPlanner:
    def __init__(self, max_drafts: int, prior_slope: float = 0.4, keep_cost: float = 0.9,
                 keep_accept: float = 0.995, budgets=None):
        """prior_slope: c1 / c0, the cost of a draft relative to a step, until two γ are measured
        (CPU ~0.4: extra verify rows are not free there; a GPU is closer to 0.1). budgets: the γ it may pick
        (ascending, from 0); None: 0..max_drafts."""
        self.budgets = list(range(max_drafts + 1)) if budgets is None else list(budgets)
        if self.budgets[0] != 0 or self.budgets[-1] != max_drafts or self.budgets != sorted(set(self.budgets)):
            raise ValueError(f"budgets: {self.budgets} must ascend from 0 to max_drafts = {max_drafts}")
        self.max_drafts, self.prior_slope = max_drafts, prior_slope
        self.keep_cost, self.keep_accept = keep_cost, keep_accept
        self.trials = [PRIOR_WEIGHT] * max_drafts
        self.hits = [PRIOR_WEIGHT * (PRIOR_ACCEPT[0] if j == 0 else PRIOR_ACCEPT[1]) for j in range(max_drafts)]
        # costs are kept per sequence (seconds / B) by batch-size class B.bit_length(): 1, 2-3, 4-7, ...,
        # so a batch that shrinks by one sequence at its tail does not start from the priors again
        self.plain = {}                  # class -> Decayed seconds of a γ = 0 step
        self.bare = {}                   # class -> the same without the MTP catch-up plain decoding skips
        self.seen = {}                   # (class, γ >= 1) -> Decayed seconds
        self.line = {}                   # class -> decayed [Σw, Σwγ, Σwγ², Σwt, Σwγt] of γ >= 1 steps
        self.steps, self.hist = 0, Counter()
        self.measured = {}               # (class, γ) -> self.steps at its last measured step
        self.pred_time = self.pred_weighted = 0.0

    # ---- the model -----------------------------------------------------------------------
    def accept(self) -> list:
        return [h / t for h, t in zip(self.hits, self.trials)]

    def expected_tokens(self, gamma: int) -> float:
        return sum(accumulate(self.accept()[:gamma], mul), 1.0)  # E(γ) = 1 + Σ_{i≤γ} Π_{j≤i} a_j

    def step_cost(self, B: int, gamma: int) -> float:
        """t_B(γ) in seconds (relative while nothing at B's class was measured)."""
        c = B.bit_length()
        plain, seen = self.plain.get(c), self.seen.get((c, gamma))
        if gamma == 0 and plain is not None:
            return B * plain.mean
        line = self._line(c, gamma, plain)
        return B * line if seen is None else B * (seen.w * seen.mean + line) / (seen.w + 1)  # the line weighs one step

    def _line(self, c: int, gamma: int, plain) -> float:
        w, sg, sgg, st, sgt = self.line.get(c, (0.0,) * 5)
        var = sgg / w - (sg / w) ** 2 if w else 0.0
        if w and var * w >= 1.0:  # enough spread in γ: the fitted line
            c1 = max((sgt / w - sg / w * st / w) / var, 0.0)
            c0 = st / w - c1 * sg / w
            if c0 > 0:
                return c0 + c1 * gamma
        # one γ measured: the prior slope through its mean; none: through the plain step's cost (or 1, relative)
        c0 = st / w / (1 + self.prior_slope * sg / w) if w else plain.mean if plain is not None else 1.0
        return c0 * (1 + self.prior_slope * gamma)

    def speedups(self, B: int, bare: bool = False) -> list:
        """E(γ) t_B(0) / t_B(γ) for γ = 0..γ_max: predicted throughput relative to plain decoding. bare: relative to
        plain decoding's own steps, which skip the catch-up that an "auto" step with γ = 0 still runs, as far as
        the drafter's time is known (none inside a compiled step's graph); the choice itself compares the steps
        "auto" can take."""
        plain = self.bare.get(B.bit_length()) if bare else None
        t0 = B * plain.mean if plain is not None else self.step_cost(B, 0)
        return [self.expected_tokens(g) * t0 / self.step_cost(B, g) for g in range(self.max_drafts + 1)]

    # ---- the loop's calls ----------------------------------------------------------------
    def choose(self, B: int) -> int:
        """γ_eff for the next step of a batch of B sequences."""
        s, n = self.speedups(B), len(self.budgets)
        best = max(range(n), key=lambda i: s[self.budgets[i]])  # an index into budgets
        self.steps += 1
        if self.steps % PROBE == 0:
            turn = (self.steps // PROBE) % 3
            probe = self.budgets[min(max(0, best - 1 if turn == 0 else best + 1 if turn == 1 else 0), n - 1)]
            if (s[probe] >= (1 - MARGIN) * s[self.budgets[best]]
                    or self.steps - self.measured.get((B.bit_length(), probe), -STALE) >= STALE):
                return probe
        return self.budgets[best]

    def observe_step(self, B: int, gamma: int, seconds: float, drafter_seconds: float, results: list):
        """A step at γ: its seconds, of which the drafter's (drafting and catch-up), and (na, nd) per sequence."""
        seconds = max(seconds, MIN_SECONDS)  # a coarse or frozen clock reads 0
        c = B.bit_length()
        if c in self.plain or c in self.line:  # a stall of the machine is not the step's cost
            seconds = min(seconds, 3 * self.step_cost(B, gamma))
        per_seq = seconds / B
        if gamma == 0:
            self.plain.setdefault(c, Decayed(self.keep_cost)).add(per_seq)
            self.bare.setdefault(c, Decayed(self.keep_cost)).add(max(seconds - drafter_seconds, MIN_SECONDS) / B)
        else:
            self.seen.setdefault((c, gamma), Decayed(self.keep_cost)).add(per_seq)
            self.line[c] = [self.keep_cost * a + b for a, b in zip(
                self.line.get(c, (0.0,) * 5), (1.0, gamma, gamma * gamma, per_seq, gamma * per_seq))]
        self.hist[gamma] += 1
        self.measured[c, gamma] = self.steps
        self.pred_time += seconds
        self.pred_weighted += self.speedups(B, bare=True)[gamma] * seconds
        k = self.keep_accept
        self.trials = [k * t for t in self.trials]
        self.hits = [k * h for h in self.hits]
        for na, nd in results:  # draft j was tried when drafts 1..j-1 were accepted
            for j in range(min(na + 1, nd)):
                self.trials[j] += 1
                self.hits[j] += j < na

    def summary(self) -> dict:
        return {"gamma_hist": dict(sorted(self.hist.items())), "accept_cond": self.accept(),
                "predicted_speedup": self.pred_weighted / self.pred_time if self.pred_time else None}
