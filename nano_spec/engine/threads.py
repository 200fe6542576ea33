"""How many CPU threads a step runs on: one when a step is too small to split (default_threads), else chosen
from measured steps (ThreadTuner).

Two OpenMP threads on a machine whose other cores are busy can run a step 10-40x slower than one thread:
every op ends in a barrier that waits for a peer the OS has descheduled. How busy the machine is cannot be
known from the work's size, and it changes while the engine runs. So the engine measures:

    segment   SEG steps on the current choice, each step's time kept per shape (B, γ), a mean that forgets fast
    probe     after `every` segments, up to SEG steps on the other choice; each is compared with the current
              choice's mean at the same shape. One step COLLAPSE x slower ends the probe at once; a probe whose
              median step is faster by MARGIN switches
    backoff   each lost probe multiplies `every` by BACKOFF (at most MAX_EVERY), so on a loaded machine the
              slow probes cost a few percent; a switch resets it
    stall     a step STALL x slower than its shape's mean (the load came) scales every shape's mean by as
              much and probes at once

It starts on one thread, the choice that cannot collapse. Plain host arithmetic; the caller applies the count.
"""
import os
from collections import Counter

import torch

SEG = 8
FIRST_EVERY = 2  # segments before the first probe: a short run on a loaded machine pays for one slow step at most
MARGIN = 1.1
BACKOFF = 4
MAX_EVERY = 64
STALL = 3.0
COLLAPSE = 2.0  # a probe step this much slower than the current choice's ends the probe at once
KEEP = 0.5  # weight of the old mean at each new step: a load that comes shows within two steps
SPLIT_WORK = 32e6  # parameters x rows per step below which one CPU thread is faster (docs/BENCHMARKS.md, Threads)
TORCH_THREADS = torch.get_num_threads()  # torch's own default (one per core), as found at import
MAX_THREADS = 4 * (os.cpu_count() or 1)   # far past any gain; an absurd count (100000) crashes torch


def default_threads(model, max_batch: int, device) -> int:
    """1 on a CPU when a step's work (parameters x max_batch) is too small to split across cores, else torch's
    default (one thread per core). Measured on the shipped 8M model: 1 thread wins at batch 1, 2 at batch 8."""
    work = sum(p.numel() for p in model.parameters()) * max_batch
    return 1 if device.type == "cpu" and work < SPLIT_WORK else TORCH_THREADS


class ThreadTuner:
    def __init__(self, most: int, tune: bool = True):
        """Chooses between 1 and `most` threads (one per core); tune=False: always `most`."""
        self.current, self.other = (1, most) if tune and most > 1 else (most, most)
        self.probing = False
        self.mean = {}                  # (shape, threads) -> seconds of a step, a fast-forgetting mean
        self.every, self.segments, self.n = FIRST_EVERY, 0, 0
        self.ratios = []                # during a probe: step time / the current choice's mean at its shape
        self.steps = Counter()          # threads -> steps run on them

    def threads(self) -> int:
        """The thread count for the next step."""
        return self.other if self.probing else self.current

    def apply(self):
        if torch.get_num_threads() != self.threads():
            torch.set_num_threads(self.threads())

    def observe(self, shape, seconds: float):
        """One step's time, run on threads() threads, at shape (B, γ)."""
        t = self.threads()
        self.steps[t] += 1
        if self.other == self.current:
            return
        base = self.mean.get((shape, self.current))
        old = self.mean.get((shape, t))
        self.mean[(shape, t)] = seconds if old is None else KEEP * old + (1 - KEEP) * seconds
        self.n += 1
        if self.probing:
            if base is not None:
                self.ratios.append(seconds / base)
            if (self.ratios and self.ratios[-1] > COLLAPSE) or self.n >= SEG:
                self._end_probe()
        elif base is not None and seconds > STALL * base:  # a load slows every shape: rescale them all
            for key in [k for k in self.mean if k[1] == t and k[0] != shape]:
                self.mean[key] *= seconds / base
            self.every = 1
            self._start_probe()
        elif self.n >= SEG:
            self.n, self.segments = 0, self.segments + 1
            if self.segments >= self.every:
                self._start_probe()

    def _start_probe(self):
        self.probing, self.n, self.segments, self.ratios = True, 0, 0, []

    def _end_probe(self):
        ratios = sorted(self.ratios)
        if ratios and ratios[-1] <= COLLAPSE and ratios[len(ratios) // 2] * MARGIN < 1:  # the other choice won
            self.current, self.other, self.every = self.other, self.current, 1
        else:
            self.every = min(self.every * BACKOFF, MAX_EVERY)
        self.probing, self.n, self.segments, self.ratios = False, 0, 0, []

