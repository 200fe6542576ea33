"""The step as one graph against the eager step, on one device (docs/DESIGN.md §12): identity, tokens/s, and the
graph step's time beside the sum of its kernels' times.

    python scripts/graph_check.py [--model DIR] [--configs none:0 mtp:3] [--prompts 8] [--max-new-tokens 48]

For each config (proposer:γ) and batch, in one process: an eager engine and LLM(compile=True) (a CUDA graph per
bucket on CUDA, torch.compile on the CPU) over the same prompts, greedy. A warm-up pass makes every bucket's
graph; then `--rounds` interleaved timed passes. A row:
  identical    the graph engine's tokens equal the eager engine's (and, for a speculative config, plain decoding's)
  tokens/s     generated tokens over wall time, eager and graph, medians
  step ms      the graph step per call as the engine runs it (phase "step": host inputs in, the replay)
  replay ms    on CUDA, the busiest bucket's graph replayed alone (device-synchronised), per replay
  kernels ms   on CUDA, the device time of that replay's kernels (torch.profiler), summed: the floor of a step
  step / kernels, the overhead factor: 1.0 would be a step that costs only its kernels
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nano_spec import LLM, SamplingParams
from nano_spec.engine.settings import shipped_weights


def timed_pass(llm, prompts, params) -> tuple:
    llm.telemetry.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    st = llm.stats
    steps = sum(st["phase_histogram_ms"]["step"])
    return [o.token_ids for o in outs], sum(len(o.token_ids) for o in outs) / seconds, \
        st["phase_seconds"]["step"] * 1e3 / max(steps, 1)


def replay_floor(llm, calls: int = 20) -> tuple:
    """CUDA: the busiest bucket's graph replayed alone -> (ms per replay, its kernels' device ms summed). Each
    replay starts from the same per-slot lengths, so its writes stay where the engine's did."""
    graph = llm.runner.graph
    if graph.mode != "cuda_graph" or not graph.graphs:
        return None, None
    g = graph.graphs[max(graph.graphs, key=graph.calls.__getitem__)][0]
    saved = llm.runner.seq_lens.clone()

    def replay():
        llm.runner.seq_lens.copy_(saved)
        g.replay()

    replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        replay()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / calls * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            replay()
        torch.cuda.synchronize()
    kernels = sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and not e.name.startswith(("Memcpy", "Memset")))
    return wall, kernels / 1e3 / calls


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the shipped weights)")
    p.add_argument("--configs", nargs="+", default=["none:0", "mtp:3"], help="proposer:γ rows")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    model = Path(args.model) if args.model else shipped_weights()
    prompts = [json.loads(line)["prompt"] for line in (model / "eval_prompts.jsonl").read_text().splitlines()]
    prompts = prompts[: args.prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rows, plain = [], {}
    for b in args.batch:
        for config in args.configs:
            proposer, gamma = config.split(":")
            kw = dict(proposer=proposer, num_drafts=int(gamma), max_batch=b, device=args.device)
            engines = {"eager": LLM(str(model), **kw), "graph": LLM(str(model), compile=True, **kw)}
            torch.set_num_threads(1) if args.device == "cpu" else None
            for llm in engines.values():  # warm-up: every bucket met, so every graph made
                llm.generate(prompts, params)
            tps = {name: [] for name in engines}
            step_ms, out = [], {}
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    out[name], t, ms = timed_pass(llm, prompts, params)
                    tps[name].append(t)
                    step_ms += [ms] if name == "graph" else []
            plain.setdefault(b, out["eager"]) if proposer == "none" else None
            replay_ms, kernels_ms = replay_floor(engines["graph"])
            step = statistics.median(step_ms)
            row = {"config": config, "batch": b, "device": args.device, "mode": engines["graph"].runner.graph.mode,
                   "identical": out["graph"] == out["eager"] and out["eager"] == plain.get(b, out["eager"]),
                   "eager tokens/s": statistics.median(tps["eager"]), "graph tokens/s": statistics.median(tps["graph"]),
                   "step ms": step, "replay ms": replay_ms, "kernels ms": kernels_ms,
                   "step / kernels": step / kernels_ms if kernels_ms else None,
                   "graphs": len(engines["graph"].runner.graph.seen),
                   "graph seconds": engines["graph"].runner.compile_seconds()}
            rows.append(row)
            floor = "" if kernels_ms is None else \
                f", replay {replay_ms:.3f} ms, kernels {kernels_ms:.3f} ms, step / kernels {row['step / kernels']:.2f}"
            print(f"{config:<8} batch {b}: identical {row['identical']}, tokens/s eager {row['eager tokens/s']:.0f} "
                  f"graph {row['graph tokens/s']:.0f} ({row['graph tokens/s'] / row['eager tokens/s']:.2f}x); step "
                  f"{step:.3f} ms{floor}; {row['graphs']} graphs made in {row['graph seconds']:.1f} s", flush=True)
    print(json.dumps(rows))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
