"""Where a step's time goes: aten ops and milliseconds per call of each engine phase.

    python scripts/step_profile.py [--model DIR] [--batch 1 8] [--gammas 0 3] [--threads 1] [--proposer mtp]
                                   [--compile]

Ops are counted with a TorchDispatchMode around each telemetry phase (one counting run);
times come from separate runs without the counter, median per phase call. With --compile every
row is profiled eager and compiled, and ops are counted from torch.profiler instead, as a
dispatch mode cannot run inside a compiled graph: the outermost aten and nano_spec ops, plus each
kernel inductor generated (its kernel profile is on), are one op each. Each eager row ends with its
"matmul floor": the weight matmuls of its device steps replayed alone, ms per step (nano_spec/bench_floor.py),
beside the step's phases, whose sum it is the floor of. Works on any
nano_spec checkout that times its phases through `telemetry.phase(name)`, so the same
script measures two versions of the engine (PYTHONPATH=<other checkout>).
"""
import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nano_spec.bench_floor import matmul_floor_ms
from nano_spec.engine.llm import LLM
from nano_spec.engine.settings import shipped_weights
from nano_spec.model.sampling import SamplingParams


class ProfiledOps:
    """The ops a region runs, by torch.profiler: outermost aten::/nano_spec:: ops and inductor's C++ kernels."""
    @staticmethod
    def counted(e) -> bool:  # inductor names its kernels graph_<n>_cpp_fused_<ops>
        return e.name.startswith(("aten::", "nano_spec::")) or "_cpp_fused" in e.name

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        counted = self.counted
        self.n = 0
        for e in self.prof.events():
            parent = e.cpu_parent
            while parent is not None and not counted(parent):
                parent = parent.cpu_parent
            self.n += counted(e) and parent is None


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def profile(llm, prompts, params, runs: int, counter_type=OpCounter) -> dict:
    """{phase: {"calls", "ops_per_call", "ms_per_call"}} over the steps of generating `prompts`."""
    timed = llm.telemetry.phase
    ops, calls, secs = {}, {}, {}
    counting = False

    @contextmanager
    def phase(name):
        counter = counter_type() if counting else nullcontext()
        t0 = time.perf_counter()
        with timed(name), counter:
            yield
        secs[name] = secs.get(name, 0.0) + time.perf_counter() - t0
        if counting:
            ops[name] = ops.get(name, 0) + counter.n
            calls[name] = calls.get(name, 0) + 1

    llm.telemetry.phase = phase
    llm.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    if llm.runner.compiled_calls():  # every bucket compiled before counting: compile-time ops are not the step's
        llm.generate(prompts, params)
    counting = True
    llm.generate(prompts, params)
    counting = False
    ms = {}
    for _ in range(runs):
        secs.clear()
        llm.generate(prompts, params)
        for name, c in calls.items():  # every run makes the same calls: greedy, same prompts, fixed γ
            ms.setdefault(name, []).append(1e3 * secs.get(name, 0.0) / c)
    return {name: {"calls": calls[name], "ops_per_call": ops[name] / calls[name],
                   "ms_per_call": statistics.median(ms[name])} for name in calls}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the shipped weights)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--gammas", type=int, nargs="+", default=[0, 3])
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--proposer", default="mtp", help="the proposer of the γ > 0 rows: mtp, dflash or ngram")
    p.add_argument("--compile", action="store_true", help="each row eager and LLM(compile=True), ops from the profiler")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else shipped_weights()
    prompts = [json.loads(line)["prompt"] for line in (model / "eval_prompts.jsonl").read_text().splitlines()]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    # with --compile each kernel inductor generates is a profiler event (for this run only: config.patch)
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}) if args.compile else nullcontext():
        rows = profile_rows(args, model, prompts, params)
    print(json.dumps(rows))


def profile_rows(args, model, prompts, params) -> list:
    """Every (batch, γ) row profiled, eager and, with --compile, compiled; printed as they come."""
    rows, counter_type = [], ProfiledOps if args.compile else OpCounter
    for b in args.batch:
        for g in args.gammas:
            kind = args.proposer if g else "none"
            for compiled in [False, True] if args.compile else [False]:
                llm = LLM(str(model), backend="torch", max_batch=b, num_drafts=g, proposer=kind, compile=compiled)
                torch.set_num_threads(args.threads)  # after LLM(), which may set its own default
                mode = "compiled" if compiled else "eager"
                phases = profile(llm, prompts[:b], params, args.runs, counter_type)
                if not compiled:
                    phases["matmul floor"] = {"calls": None, "ops_per_call": None, "ms_per_call": matmul_floor_ms(
                        llm, lambda: llm.generate(prompts[:b], params))["aten"]}
                for name, r in phases.items():
                    rows.append({"batch": b, "gamma": g, "proposer": kind, "mode": mode, "phase": name, **r})
                    counts = "" if r["calls"] is None else \
                        f"calls {r['calls']:>4}  ops/call {r['ops_per_call']:>7.1f}  "
                    print(f"batch {b:>2} γ={g} {kind:<6} {mode:<8} {name:<12} {counts:<33}"
                          f"ms/call {r['ms_per_call']:>7.2f}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
