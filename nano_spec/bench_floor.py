"""The matmul floor of a bench row (python -m nano_spec.bench, docs/BENCHMARKS.md): the matmuls that read a weight in
the device steps of one pass, recorded with their own tensors and replayed alone. The same aten calls run, so the
same GEMM path and weight layout: what the steps would cost if they were only their matmuls.

    floor ms = replay seconds (median of rounds) / engine steps of the pass
"""
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MATMULS = ("mm", "addmm", "bmm")  # the aten calls a linear becomes


class WeightMatmuls(TorchDispatchMode):
    """Records the matmuls that read a weight (a tensor on a storage of `weights`), with a copy of their other
    tensors, as they run."""

    def __init__(self, weights: set):
        super().__init__()
        self.weights, self.calls = weights, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = [isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.weights for a in args]
        if func.overloadpacket.__name__ in MATMULS and any(reads):
            self.calls.append((func, [a.clone() if isinstance(a, torch.Tensor) and not w else a
                                      for a, w in zip(args, reads)], kwargs))
        return func(*args, **kwargs)


def record(llm, run) -> tuple:
    """run(), a pass of an eager engine llm -> (the weight matmuls its device steps ran, as (func, args, kwargs);
    the number of device steps)."""
    nets = [m for m in (llm.model, getattr(llm.drafter, "net", None)) if m is not None]
    weights = {t.untyped_storage().data_ptr() for net in nets  # the fused q/k/v weights are buffers
               for t in [*net.parameters(), *net.buffers()]}
    recorder, step, steps = WeightMatmuls(weights), llm.runner.graph.fn, []

    def recorded(*args, **kw):
        steps.append(1)
        with recorder:
            return step(*args, **kw)

    llm.runner.graph.fn = recorded
    try:
        run()
    finally:
        llm.runner.graph.fn = step
    return recorder.calls, len(steps)


def matmul_floor_ms(llm, run, rounds: int = 3) -> float:
    """floor ms of an eager engine llm: the weight matmuls of run()'s device steps, replayed alone, per step."""
    calls, steps = record(llm, run)
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for func, args, kwargs in calls:
            func(*args, **kwargs)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds) * 1e3 / max(steps, 1)
