"""The matmul floor of a bench row (python -m nano_spec.bench, docs/BENCHMARKS.md): the matmuls that read a weight in
the device steps of one pass, recorded with their own tensors and replayed alone. The same aten calls run, so the
same GEMM path and weight layout: what the steps would cost if they were only their matmuls. A compiled engine
that packs its weights (nano_spec/model/cpu_rows.py) runs the products of few rows in C instead: its floor replays
those through rows_mm over packed copies of the same weights, in int8 for the drafter's calls as the engine packs them.

    floor ms = replay seconds (median of rounds) / engine steps of the pass
"""
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nano_spec.model.cpu_rows import DRAFT_DTYPE, on_huge_pages, pack_rows, rows_mm, runs_in_c

MATMULS = ("mm", "addmm", "bmm")  # the aten calls a linear becomes


class WeightMatmuls(TorchDispatchMode):
    """Records the matmuls that read a weight (a tensor whose data starts where one of `weights` does: a linear
    passes its weight transposed, a view of the same data), with a copy of their other tensors, as they run, and
    the indices of those made while `drafting`."""

    def __init__(self, weights: set):
        super().__init__()
        self.weights, self.calls, self.drafted, self.drafting = weights, [], set(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = [isinstance(a, torch.Tensor) and a.data_ptr() in self.weights for a in args]
        if func.overloadpacket.__name__ in MATMULS and any(reads):
            if self.drafting:
                self.drafted.add(len(self.calls))
            self.calls.append((func, [a.clone() if isinstance(a, torch.Tensor) and not w else a
                                      for a, w in zip(args, reads)], kwargs))
        return func(*args, **kwargs)


def record(llm, run) -> tuple:
    """run(), a pass of an eager engine llm -> (the weight matmuls its device steps ran, as (func, args, kwargs);
    the indices of those its device drafter ran; the number of device steps)."""
    drafter = llm.drafter if llm.runner.device_drafter else None
    nets = [llm.model, *(drafter.nets if drafter else ())]  # a DraftHead's weight is the target's
    weights = {t.data_ptr() for net in nets  # the fused q/k/v weights are buffers
               for t in [*net.parameters(), *net.buffers()]}
    recorder, step, steps = WeightMatmuls(weights), llm.runner.graph.fn, []

    def drafting(method):
        def call(*args, **kw):
            recorder.drafting = True
            try:
                return method(*args, **kw)
            finally:
                recorder.drafting = False
        return call

    def recorded(*args, **kw):
        steps.append(1)
        with recorder:
            return step(*args, **kw)

    llm.runner.graph.fn = recorded
    if drafter:  # instance attributes over the class's methods, removed after
        drafter.draft_rows, drafter.catch_up_rows = drafting(drafter.draft_rows), drafting(drafter.catch_up_rows)
    try:
        run()
    finally:
        llm.runner.graph.fn = step
        if drafter:
            del drafter.draft_rows, drafter.catch_up_rows
    return recorder.calls, recorder.drafted, len(steps)


def as_packed(calls, drafted=frozenset()) -> list:
    """The recorded calls as a packing compiled step runs them: mm(x, w) and addmm(b, x, w) whose rows run in C
    (cpu_rows.runs_in_c) through rows_mm over w's packed copy (made here, once per weight and dtype, on huge pages
    as the engine's are; int8 for the calls in `drafted`, a drafter's; the bias add left out), the rest as they
    are. w is the weight as a linear passes it, (in, out). rows_mm is called straight: the operator and Python
    around it in a step are the step's overhead, not its matmuls."""
    weights, plan = {}, []  # (data pointer, shape, strides, dtype) -> w; per call, (x, w's key) or None
    for i, (func, args, kwargs) in enumerate(calls):
        x, w = {"mm": args[:2], "addmm": args[1:3]}.get(func.overloadpacket.__name__, (None, None))
        dtype = DRAFT_DTYPE if i in drafted else torch.float32
        if x is None or x.dtype != torch.float32 or not runs_in_c(x.shape[0], dtype):
            plan.append(None)
            continue
        key = (w.data_ptr(), tuple(w.shape), w.stride(), dtype)
        weights.setdefault(key, w)
        plan.append((x, key))
    packs = dict(zip(weights, on_huge_pages([pack_rows(w.t(), key[-1]) for key, w in weights.items()])))
    return [call if p is None else (rows_mm, (p[0], packs[p[1]], weights[p[1]].shape[1]), {})
            for call, p in zip(calls, plan)]


def matmul_floor_ms(llm, run, rounds: int = 3) -> dict:
    """floor ms of an eager engine llm: the weight matmuls of run()'s device steps, replayed alone, per step, as
    recorded ("aten") and as a packing compiled engine of the same configuration runs them ("rows", as_packed)."""
    calls, drafted, steps = record(llm, run)
    paths = {"aten": calls, "rows": as_packed(calls, drafted)}
    seconds = {path: [] for path in paths}
    for _ in range(rounds):
        for path, replay in paths.items():  # interleaved
            t0 = time.perf_counter()
            for func, args, kwargs in replay:
                func(*args, **kwargs)
            seconds[path].append(time.perf_counter() - t0)
    return {path: statistics.median(s) * 1e3 / max(steps, 1) for path, s in seconds.items()}
