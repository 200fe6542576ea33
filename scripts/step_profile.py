"""Where a step's time goes: aten ops and milliseconds per call of each engine phase.

    python scripts/step_profile.py [--model DIR] [--batch 1 8] [--gammas 0 3] [--threads 1] [--proposer mtp]

Ops are counted with a TorchDispatchMode around each telemetry phase (one counting run);
times come from separate runs without the counter, median per phase call. Works on any
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

from nano_spec.llm import LLM, shipped_weights
from nano_spec.sampling import SamplingParams


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def profile(llm, prompts, params, runs: int) -> dict:
    """{phase: {"calls", "ops_per_call", "ms_per_call"}} over the steps of generating `prompts`."""
    timed = llm.telemetry.phase
    ops, calls, secs = {}, {}, {}
    counting = False

    @contextmanager
    def phase(name):
        counter = OpCounter() if counting else nullcontext()
        t0 = time.perf_counter()
        with timed(name), counter:
            yield
        secs[name] = secs.get(name, 0.0) + time.perf_counter() - t0
        if counting:
            ops[name] = ops.get(name, 0) + counter.n
            calls[name] = calls.get(name, 0) + 1

    llm.telemetry.phase = phase
    llm.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
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
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else shipped_weights()
    prompts = [json.loads(line)["prompt"] for line in (model / "eval_prompts.jsonl").read_text().splitlines()]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows = []
    for b in args.batch:
        for g in args.gammas:
            kind = args.proposer if g else "none"
            llm = LLM(str(model), backend="torch", max_batch=b, num_drafts=g, proposer=kind)
            torch.set_num_threads(args.threads)  # after LLM(), which may set its own default
            for name, r in profile(llm, prompts[:b], params, args.runs).items():
                rows.append({"batch": b, "gamma": g, "proposer": kind, "phase": name, **r})
                print(f"batch {b:>2} γ={g} {kind:<6} {name:<8} calls {r['calls']:>4}  ops/call {r['ops_per_call']:>7.1f}  "
                      f"ms/call {r['ms_per_call']:>7.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    sys.exit(main())
