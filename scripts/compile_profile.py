"""Where a compiled verify's time goes, beside the eager one and the matmul floor (docs/BENCHMARKS.md).

    python scripts/compile_profile.py [--model DIR] [--k 1 4] [--dtype float32|bfloat16] [--threads 1] [--top 8]

For each K (rows per sequence, batch 1), in one process, interleaved:
  - eager ms: HybridLM.verify as the engine runs it without compile;
  - compiled ms: the same call through torch.compile as the compiled step runs it (nano_spec/engine/graph.py's
    settings and ops; its first call's compile time beside);
  - matmul floor ms: every linear of the target and the tied lm_head alone, at K rows, through ATen's GEMM (what
    eager runs): the least an eager step can cost;
  - gemm floor ms: the same matmuls compiled as the compiled call's are (--gemm: inductor's C++ GEMM template over
    frozen weights, cpu_rows' C over packed copies, or ATen's): the least a compiled step can cost;
  - stream ms: one pass (a sum) over as many bytes as those weights, what one core's memory bandwidth allows;
  - stash floor ms: every Mamba layer's state read once and written to its K stash rows (one copy_), the bytes
    the K-row recurrence must move whatever computes it;
then the compiled call's ops by self CPU time (torch.profiler), per call.

    matmul GB/s = weight bytes / matmul floor time
    floor = gemm floor + stash floor: the least a compiled verify can cost; K=4 / K=1 of it is the ratio's ceiling
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from nano_spec.engine.capacity import weight_bytes
from nano_spec.engine.graph import Compiled, gemm_template
from nano_spec.engine.llm import LLM
from nano_spec.model.cpu_rows import linear, pack_linears, pack_rows
from nano_spec.model.graph_ops import use_graph_ops
from nano_spec.engine.settings import shipped_weights


def mean_ms(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


class Linears(torch.nn.Module):
    """The weights' matmuls alone, as parameters (frozen into a compiled graph as the model's are); packed: over
    packed copies (cpu_rows.linear), as a compiled step below the template's threshold runs them in fp32."""

    def __init__(self, weights, packed: bool):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(w, requires_grad=False) for w in weights)
        self.packed = [pack_rows(w) if packed else None for w in weights]

    def forward(self, xs):
        return [linear(x, w, None, p) for x, w, p in zip(xs, self.weights, self.packed)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the shipped weights)")
    p.add_argument("--k", type=int, nargs="+", default=[1, 4], help="rows per sequence of the verifies timed")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the weights' and caches'")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    p.add_argument("--calls", type=int, default=20, help="calls per round")
    p.add_argument("--top", type=int, default=8, help="ops listed from the compiled call's profile")
    p.add_argument("--gemm", choices=["auto", "template", "rows", "aten"], default="auto",
                   help="the compiled call's matmuls: inductor's C++ GEMM template, C over packed weights (fp32) or "
                        "ATen's (auto: as the engine chooses, by the weights' size and dtype)")
    args = p.parse_args(argv)
    if min(args.k) < 1 or args.rounds < 1 or args.calls < 1:
        p.error("--k, --rounds and --calls must be at least 1")
    model = Path(args.model) if args.model else shipped_weights()
    # n-gram sizes the caches for K rows and needs no weights of its own
    kw = dict(backend="torch", device="cpu", max_batch=1, proposer="ngram", num_drafts=max(args.k) - 1 or 1,
              dtype=args.dtype)
    eager, compiled = LLM(str(model), **kw), LLM(str(model), **kw)
    use_graph_ops(compiled.model.ops, compiled=True)
    gemm = args.gemm if args.gemm != "auto" else "template" if gemm_template(weight_bytes(
        compiled.config.cfg, compiled.config.dtype)) else "rows" if args.dtype == "float32" else "aten"
    template = gemm == "template"
    if gemm == "rows":
        pack_linears(compiled.model)
    verify = Compiled(compiled.model.verify, template)  # one graph per K
    torch.set_num_threads(args.threads)  # after LLM(), which may set its own default
    m = eager.model
    weights = [mod.weight for name, mod in m.named_modules()
               if isinstance(mod, torch.nn.Linear) and not name.startswith("mtp")] + [m.model.embed_tokens.weight]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.empty(nbytes // 4).normal_()
    rows = []
    with torch.no_grad():
        for K in args.k:
            ids = torch.randint(0, m.cfg.vocab_size, (1, K))
            slots, seq_lens = torch.tensor([0]), torch.tensor([32])
            xs = [torch.randn(1, K, w.shape[1], dtype=w.dtype) for w in weights]
            linears = Compiled(Linears(weights, packed=gemm == "rows").forward, template)
            linears(K, xs)
            t0 = time.perf_counter()
            verify(K, ids, slots, seq_lens, compiled.runner.cache, 32 + K)
            compile_s = time.perf_counter() - t0
            stash, state = eager.runner.cache.ssm_stash(1, K), eager.runner.cache.ssm_state[:, :1, None]
            timed = {
                "eager": lambda: m.verify(ids, slots, seq_lens, eager.runner.cache, 32 + K),
                "compiled": lambda: verify(K, ids, slots, seq_lens, compiled.runner.cache, 32 + K),
                "matmul floor": lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
                "gemm floor": lambda: linears(K, xs),
                "stream": lambda: flat.sum(),
                "stash floor": lambda: stash.copy_(state.expand_as(stash)),  # (Lm, 1, K, H, P, N)
            }
            ms = {name: [] for name in timed}
            for _ in range(args.rounds):
                for name, fn in timed.items():
                    ms[name].append(mean_ms(fn, args.calls))
            row = {"K": K, "dtype": args.dtype, "gemm": gemm, "compile_s": compile_s,
                   "weight_MiB": nbytes / 2**20, **{f"{n} ms": statistics.median(v) for n, v in ms.items()}}
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.calls):
                    timed["compiled"]()
            top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
            row["compiled_ops"] = [{"op": e.key, "calls_per_step": e.count / args.calls,
                                    "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.calls} for e in top]
            rows.append(row)
            print(f"K={K} ({row['gemm']} GEMM): eager {row['eager ms']:.2f} ms, compiled {row['compiled ms']:.2f} ms "
                  f"(first call {compile_s:.1f} s), matmul floor {row['matmul floor ms']:.2f} ms "
                  f"({nbytes / row['matmul floor ms'] / 1e6:.1f} GB/s over {row['weight_MiB']:.1f} MiB of weights), "
                  f"gemm floor {row['gemm floor ms']:.2f} ms ({nbytes / row['gemm floor ms'] / 1e6:.1f} GB/s), "
                  f"stream {row['stream ms']:.2f} ms ({nbytes / row['stream ms'] / 1e6:.1f} GB/s), "
                  f"stash floor {row['stash floor ms']:.2f} ms "
                  f"({stash.numel() * 4 / row['stash floor ms'] / 1e6:.1f} GB/s written)")
            for op in row["compiled_ops"]:
                print(f"    {op['op'][:48]:<48} {op['calls_per_step']:>6.1f} calls  {op['self_ms_per_step']:>7.3f} ms")
    if len(rows) > 1:
        floor = [r["gemm floor ms"] + r["stash floor ms"] for r in rows]
        compiled = rows[-1]["compiled ms"] / rows[0]["compiled ms"]
        print(f"K={rows[-1]['K']} / K={rows[0]['K']}: compiled {compiled:.2f}x, floor (gemm + stash) "
              f"{floor[-1] / floor[0]:.2f}x")
    print(json.dumps(rows))


if __name__ == "__main__":
    sys.exit(main())
