"""The default CPU thread count against fixed ones, on a machine whose cores other processes keep busy.

    python scripts/threads_under_load.py [--busy 1] [--rounds 3] [--max-new-tokens 64] [--prompts 4]

Starts --busy processes that spin (0: an idle machine), then times, interleaved in one process, engines that
differ only in `threads`: None (the default: one thread for a small step, else chosen from measured steps,
nano_spec/engine/threads.py), 1, and one per core. Each engine's scheduler sets its own count before every step, so
they share the process. Two workloads: the demo's (the first --prompts eval prompts one at a time, as
`python -m nano_spec.generate` runs one prompt) and a batch of 8 (every slot busy: where more threads pay
on an idle machine). Reports the median tokens/s over the rounds, the CPU seconds beside the wall seconds,
and the steps each engine ran on each thread count; outputs are checked identical across engines.
"""
import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

import torch

from nano_spec.engine.llm import LLM
from nano_spec.engine.settings import shipped_weights
from nano_spec.model.sampling import SamplingParams


def spin():
    while True:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--busy", type=int, default=1, help="spinning processes beside the engine")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=4, help="prompts of the one-at-a-time workload")
    args = p.parse_args(argv)
    model = shipped_weights()
    prompts = [json.loads(line)["prompt"] for line in open(model / "eval_prompts.jsonl", encoding="utf-8")]
    cores = torch.get_num_threads()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    workloads = {"one at a time": [[q] for q in prompts[: args.prompts]], "batch of 8": [prompts[:8]]}
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for proc in busy:
        proc.start()
    try:
        for name, calls in workloads.items():
            engines = {label: LLM(model, threads=threads, max_batch=8) for label, threads in
                       (("default", None), ("1 thread", 1), (f"{cores} threads", cores))}
            times, outputs = {label: [] for label in engines}, {}
            for _ in range(args.rounds):
                for label, llm in engines.items():  # interleaved: a change of load hits every engine alike
                    w0, c0 = time.perf_counter(), time.process_time()
                    outs = [o.token_ids for call in calls for o in llm.generate(call, params)]
                    times[label].append((time.perf_counter() - w0, time.process_time() - c0))
                    outputs.setdefault(label, outs)
            if any(o != outputs["default"] for o in outputs.values()):
                print(f"error: {name}: outputs differ between thread counts", file=sys.stderr)
                return 1
            tokens = sum(len(o) for o in outputs["default"])
            print(f"{name}: {args.busy} busy process(es) on {os.cpu_count()} cores, {tokens} tokens, "
                  f"median of {args.rounds} interleaved rounds")
            print("  engine      tokens/s  wall s  CPU s  steps on each thread count")
            for label, llm in engines.items():
                wall = statistics.median(w for w, _ in times[label])
                cpu = statistics.median(c for _, c in times[label])
                print(f"  {label:<10} {tokens / wall:9.1f} {wall:7.2f} {cpu:6.2f}  {llm.stats['threads']}")
    finally:
        for proc in busy:
            proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
