"""The kernel bench: every kernel of nano_spec_kernels timed beside its torch reference, the reference under
torch.compile and the well-known kernels for the same job (when installed), at the decode sizes of the shipped model
and Granite 4.0-H 350m and 1b, in fp32 and bf16 (the sweeps: bench_cases.py).

    python -m nano_spec_kernels.bench [--quick] [--kernels a,b] [--models ...] [--dtypes ...] [--out DIR]
                                      [--peak-gbps GBPS] [--no-compile]
    python -m nano_spec_kernels.bench --predict [--model ...] [--tau T] [--ctx N] [--tbs TB/s]

One row per kernel x model x dtype x size x implementation (the CSV's columns, COLUMNS):
  time_us      per call, launch included: triton.testing.do_bench on CUDA (median; L2 flushed before each call),
               else the median of a wall clock over a few calls after a warm-up call
  graph_us     per call replayed from a CUDA graph (triton.testing.do_bench_cudagraph, median): no launch cost, and
               L2 stays warm, so a working set that fits in L2 can pass the HBM peak; CUDA only
  bytes        what one call must move, by the formula beside the kernel (`<op>_bytes`, the roofline's too); the same
               for every implementation of the job, so their GB/s compare like with like
  gbps         bytes / time; pct_peak = gbps / the HBM peak (graph_gbps, graph_pct_peak: the same from graph_us)
  tflops       flops / time, for the prefill kernels (attention_prefill, mamba_scan)
  vs_ref       the reference's time / this time
With --out DIR each kernel writes DIR/<kernel>.csv and DIR/<kernel>.png as soon as it is done (GB/s against the
swept size, one line per implementation, one panel per model and dtype; needs matplotlib, the `bench` extra).
On a CPU the Triton kernels run in Triton's interpreter, whose times say nothing about a GPU: only --quick runs them
(at tiny sizes, to check that every kernel and column works); --quick leaves torch.compile out on a CPU.
"""
import argparse
import csv
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

COLUMNS = ("kernel", "model", "dtype", "size", "impl", "time_us", "graph_us", "bytes", "gbps", "graph_gbps",
           "peak_gbps", "pct_peak", "graph_pct_peak", "flops", "tflops", "vs_ref", "device", "note")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# HBM bandwidth by device name, GB/s, from the datasheets; the first name found in the device's wins
HBM_PEAK_GBPS = (("GH200", 4000.0), ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("B200", 8000.0),
                 ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0), ("L40S", 864.0), ("A10", 600.0))
# do_bench's budgets per implementation: hundreds of calls at decode sizes, enough for a stable median, and short
# enough for the full sweep's ~1,300 timings to fit scripts/gpu_check.sh
CUDA_WARMUP_MS, CUDA_REP_MS, GRAPH_REP_MS = 5, 25, 10
CPU_REPS, QUICK_REPS = 10, 3  # timed calls after the warm-up call
RECOMPILE_LIMIT = 64  # the sweep's shapes and dtypes recompile each reference; past dynamo's limit it runs eagerly


def peak_gbps(device: str, override: float | None) -> float | None:
    """The HBM peak in GB/s: --peak-gbps, else the device's from HBM_PEAK_GBPS; None (n/a) for a CPU or another GPU."""
    return override or next((gbps for name, gbps in HBM_PEAK_GBPS if name in device), None)


def wall_us(fn, reps: int, cuda: bool) -> float:
    """Median microseconds per call of fn() by the wall clock (each call waited for on CUDA)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def measure(call, cuda: bool, reps: int, has_triton: bool) -> tuple:
    """(time_us, graph_us, note) of one implementation; time_us None when it fails (the note says why)."""
    try:
        call()  # the warm-up: the first call compiles (Triton, torch.compile), and must run at all
        if cuda:
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (one implementation failing must not stop the sweep)
        return None, None, f"failed: {_first_line(e)}"
    if not (cuda and has_triton):  # do_bench needs CUDA and triton
        return wall_us(call, reps, cuda), None, ""
    import triton.testing

    t = 1e3 * triton.testing.do_bench(call, warmup=CUDA_WARMUP_MS, rep=CUDA_REP_MS, return_mode="median")
    if not call.graph:
        return t, None, "no CUDA graph (host-side work between launches)"
    try:
        return t, 1e3 * triton.testing.do_bench_cudagraph(call, rep=GRAPH_REP_MS, return_mode="median"), ""
    except Exception as e:  # noqa: BLE001
        return t, None, f"CUDA graph failed: {_first_line(e)}"


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def make_row(kernel: str, model: str, dtype: str, size: str, impl: str, time_us: float, graph_us: float | None,
             nbytes: int, flops: int, peak: float | None, ref_us: float | None, device: str, note: str) -> dict:
    """One result row, every derived column computed here."""
    gbps = nbytes / (time_us * 1e-6) / 1e9  # GB/s = bytes moved / seconds per call / 1e9
    graph_gbps = nbytes / (graph_us * 1e-6) / 1e9 if graph_us else None
    return dict(kernel=kernel, model=model, dtype=dtype, size=size, impl=impl, time_us=time_us, graph_us=graph_us,
                bytes=nbytes, gbps=gbps, graph_gbps=graph_gbps, peak_gbps=peak,
                pct_peak=100 * gbps / peak if peak else None,
                graph_pct_peak=100 * graph_gbps / peak if peak and graph_gbps else None,
                flops=flops or None, tflops=flops / (time_us * 1e-6) / 1e12 if flops else None,
                vs_ref=ref_us / time_us if ref_us else None, device=device, note=note)


TABLE = (("model", "<8"), ("dtype", "<5"), ("size", "<21"), ("impl", "<17"), ("time us", ">10"), ("graph us", ">9"),
         ("MB", ">9"), ("GB/s", ">9"), ("% peak", ">7"), ("graph %", ">7"), ("TFLOP/s", ">9"), ("vs ref", ">8"),
         ("note", ""))  # the printed table's cells: (heading, format)


def _line(cells) -> str:
    return " ".join(format(c, fmt) for c, (_, fmt) in zip(cells, TABLE)).rstrip()


def _num(v: float | None) -> str:
    """A table cell: one decimal from 10 up, else 3 significant digits; "-" where nothing was measured."""
    return "-" if v is None else f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def format_row(r: dict) -> str:
    pct = (_num(r["pct_peak"]), _num(r["graph_pct_peak"])) if r["peak_gbps"] else ("n/a", "n/a")  # no peak: say so
    return _line((r["model"], r["dtype"], r["size"], r["impl"], _num(r["time_us"]), _num(r["graph_us"]),
                  _num(r["bytes"] / 1e6), _num(r["gbps"]), *pct, _num(r["tflops"]), _num(r["vs_ref"]), r["note"]))


HEADER = _line(heading for heading, _ in TABLE)


def write_csv(rows: list, path: Path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        for r in rows:  # floats to 6 significant digits; empty where a column does not apply
            w.writerow({k: "" if v is None else format(v, ".6g") if isinstance(v, float) else v for k, v in r.items()})


def plot(rows: list, kernel: str, path: Path, peak: float | None, device: str):
    """triton.testing.perf_report's picture: GB/s against the swept size, one line per implementation (solid:
    launch included; dashed: CUDA graph), the HBM peak dotted; one panel per model and dtype."""
    from matplotlib.figure import Figure  # not pyplot: no global figure state, no display backend

    panels = list(dict.fromkeys((r["model"], r["dtype"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))  # one colour per implementation in every panel
    cols = len(dict.fromkeys(d for _, d in panels))
    fig = Figure(figsize=(6 * cols, 3.8 * -(-len(panels) // cols)), layout="constrained")
    axes = list(fig.subplots(-(-len(panels) // cols), cols, squeeze=False).flat)
    for ax, (model, dtype) in zip(axes, panels):
        sub = [r for r in rows if (r["model"], r["dtype"]) == (model, dtype)]
        sizes = list(dict.fromkeys(r["size"] for r in sub))  # the sweep's order
        for i, impl in enumerate(impls):
            mine = [r for r in sub if r["impl"] == impl]
            for key, style, label in (("gbps", "o-", impl), ("graph_gbps", "s--", f"{impl} (CUDA graph)")):
                pts = [(sizes.index(r["size"]), r[key]) for r in mine if r[key]]
                if pts:
                    ax.plot(*zip(*pts), style, color=f"C{i % 10}", label=label, markersize=4)
        if peak:
            ax.axhline(peak, color="gray", linestyle=":", label=f"HBM peak {peak:.0f} GB/s")
        ax.set_xticks(range(len(sizes)), sizes, rotation=30, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set(title=f"{model} {dtype}", xlabel="size", ylabel="GB/s (bytes / time)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)  # the grid's cells past the last panel
    fig.suptitle(f"{kernel} on {device}\nGB/s = bytes / time; solid: launch included, dashed: CUDA graph",
                 fontsize="medium")
    fig.savefig(path, dpi=90)


def predict(argv: list) -> int:
    """The roofline on paper: tests/bench/roofline.py, in its own process, because it reads the model configs from
    nano_spec, which this package never imports."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "tests" / "bench" / "roofline.py").is_file():
        sys.exit("--predict runs tests/bench/roofline.py of the repository checkout, which is not beside this package")
    path = os.pathsep.join(filter(None, [str(root), str(root / "kernels"), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "tests.bench.roofline", *argv], cwd=root,
                          env=dict(os.environ, PYTHONPATH=path)).returncode


def parser(kernels: list, models: list) -> argparse.ArgumentParser:
    def names(choices):
        def parse(text: str) -> list:
            picked = [n.strip() for n in text.split(",") if n.strip()]
            bad = [n for n in picked if n not in choices]
            if bad or not picked:
                raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'nothing'}: pick from {', '.join(choices)}")
            return picked
        return parse

    ap = argparse.ArgumentParser(prog="python -m nano_spec_kernels.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="columns: " + ", ".join(COLUMNS) + " (docs/BENCHMARKS.md, Kernels)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes, 3 timed calls; the Triton kernels too (in the interpreter on a CPU)")
    ap.add_argument("--kernels", type=names(kernels), default=kernels,
                    help="comma-separated, of: " + ", ".join(kernels))
    ap.add_argument("--models", type=names(models), default=models, help="comma-separated model shapes, of: "
                    + ", ".join(models) + " (--quick uses one tiny shape)")
    ap.add_argument("--dtypes", type=names(list(DTYPES)), default=list(DTYPES), help="comma-separated: fp32, bf16")
    ap.add_argument("--out", type=Path, help="write <kernel>.csv and <kernel>.png here")
    ap.add_argument("--peak-gbps", type=float, help="the HBM peak for %% of peak (default: by device name; a CPU: n/a)")
    ap.add_argument("--no-compile", action="store_true", help="leave the torch.compile'd reference out")
    ap.add_argument("--predict", action="store_true", help="print the roofline on paper instead, running nothing; "
                    "the options after it go to tests/bench/roofline.py (--model, --tau, --ctx, --tbs)")
    return ap


class Settings(NamedTuple):
    """What main decides once for every kernel: where (env, the device's name, its HBM peak), over what (models: name
    -> Shape, dtypes), and which implementations and timer (compile_ref, run_triton, has_triton, reps, quick)."""
    env: object
    device: str
    peak: float | None
    models: dict
    dtypes: list
    quick: bool
    compile_ref: bool
    run_triton: bool
    has_triton: bool
    reps: int


def bench_kernel(kernel: str, spec, s: Settings) -> tuple[list, list]:
    """Time every implementation of one kernel at every model, dtype and size, printing each row as it comes;
    return (rows, notes). A case or implementation that fails becomes a note, and the sweep goes on."""
    torch.manual_seed(0)  # the same inputs whichever kernels run before
    rows, compiled = [], None
    notes = {f"torch.compile: {spec.no_compile}": None} if spec.no_compile else {}  # a dict: ordered, unique
    for model, shape in s.models.items():
        for dtype in s.dtypes:
            for size in spec.sizes(shape, s.quick):
                label = " ".join(f"{k}={v}" for k, v in size.items())
                try:
                    setup = spec.build(shape, size, DTYPES[dtype], s.env)
                except Exception as e:  # noqa: BLE001 (out of memory at one size, say)
                    notes[f"{model} {dtype} {label}: not built: {type(e).__name__}: {e}"[:200]] = None
                    continue
                notes.update(dict.fromkeys(setup.notes))
                calls = dict(setup.calls)
                if s.compile_ref and not spec.no_compile:
                    if compiled is None:  # one per kernel: dynamo recompiles it for new shapes and dtypes
                        compiled = torch.compile(calls["ref"].fn)
                    calls = {"ref": calls["ref"], "ref+compile": calls["ref"]._replace(fn=compiled), **calls}
                if not s.run_triton:
                    calls = {k: v for k, v in calls.items() if not k.startswith("triton")}
                ref_us = None
                for impl, call in calls.items():
                    t, g, note = measure(call, s.env.cuda, s.reps, s.has_triton)
                    if t is None:
                        notes[f"{impl}, {model} {dtype} {label}: {note}"] = None
                        continue
                    ref_us = t if impl == "ref" else ref_us
                    rows.append(make_row(kernel, model, dtype, label, impl, t, g, setup.nbytes, setup.flops, s.peak,
                                         ref_us, s.device, note))
                    print(format_row(rows[-1]), flush=True)
                del setup, calls  # free this size's tensors before the next is built
    return rows, list(notes)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--predict" in argv:
        return predict([a for a in argv if a != "--predict"])
    cuda = torch.cuda.is_available()
    if not cuda:  # @triton.jit reads this when a kernel module is first imported: the interpreter on a CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from nano_spec_kernels import bench_cases
    from nano_spec_kernels.common import HAS_TRITON, sm_count, triton

    args = parser(list(bench_cases.KERNELS), list(bench_cases.MODELS)).parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})"
    s = Settings(env=bench_cases.Env(device, cuda, sm_count(device)), device=name,
                 peak=peak_gbps(name if cuda else "", args.peak_gbps),
                 models={"tiny": bench_cases.TINY} if args.quick else {m: bench_cases.MODELS[m] for m in args.models},
                 dtypes=args.dtypes, quick=args.quick, compile_ref=not args.no_compile and (cuda or not args.quick),
                 run_triton=HAS_TRITON and (cuda or args.quick), has_triton=HAS_TRITON,
                 reps=QUICK_REPS if args.quick else CPU_REPS)
    plots = args.out is not None and importlib.util.find_spec("matplotlib") is not None
    if args.quick and not cuda:  # tiny shapes gain nothing from threads, and a busy machine stalls spinning ones
        torch.set_num_threads(1)

    print(f"device: {name}; torch {torch.__version__}, triton {triton.__version__ if HAS_TRITON else 'absent'}; "
          f"HBM peak: {f'{s.peak:.0f} GB/s' if s.peak else 'n/a (--peak-gbps sets one)'}")
    print("time: " + ("triton.testing.do_bench (median, launch included) and do_bench_cudagraph (graph us)"
                      if cuda and HAS_TRITON else f"median of {s.reps} wall-clock calls after a warm-up call, "
                      f"{torch.get_num_threads()} torch thread(s)"))
    if not s.run_triton:
        print("triton kernels: not timed (" + ("triton is not installed" if not HAS_TRITON else
              "no CUDA; --quick runs them in the interpreter, at tiny sizes") + ")")
    if not s.compile_ref:
        print("torch.compile: not timed (" + ("--no-compile" if args.no_compile else
              "--quick on a CPU: compiling the references would take longer than the whole run") + ")")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        if not plots:
            print("plots: need matplotlib (pip install 'nano-spec[bench]'); writing the CSVs only")

    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{limit: RECOMPILE_LIMIT}):
        for kernel in args.kernels:
            started = time.perf_counter()
            print(f"\n== {kernel}\n{HEADER}", flush=True)
            rows, notes = bench_kernel(kernel, bench_cases.KERNELS[kernel], s)
            for note in notes:
                print(f"  note: {note}")
            if args.out:  # each kernel's files as soon as it is done: a run cut short keeps them
                write_csv(rows, args.out / f"{kernel}.csv")
                if plots and rows:
                    plot(rows, kernel, args.out / f"{kernel}.png", s.peak, name)
            print(f"  ({len(rows)} rows in {time.perf_counter() - started:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
