"""The kernel bench, python -m nano_spec_kernels.bench (docs/BENCHMARKS.md, "Kernels"): --quick writes a CSV and a
PNG for every kernel of the package, the CSVs have the documented columns, their GB/s, % of peak, TFLOP/s and ratios
follow from bytes and time, --kernels picks, --help works, and without matplotlib --out still writes the CSVs.

The quick run is in process: conftest has set TRITON_INTERPRET=1 before the kernels were imported (on a machine
without CUDA), so the Triton kernels run in the interpreter. The entry point itself runs as a subprocess. Nothing
here depends on how fast anything ran.
"""
import csv
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nano_spec_kernels import bench
from nano_spec_kernels.rmsnorm import rmsnorm_bytes

ROOT = Path(__file__).resolve().parents[1]
KERNEL_DIR = ROOT / "kernels" / "nano_spec_kernels"
# every kernel file of the package (not the shared pieces, not the bench's own files), and attention_block, which
# lives in attention_verify.py: a kernel added without a bench case fails here
KERNELS = {p.stem for p in KERNEL_DIR.glob("*.py")
           if p.stem not in ("__init__", "common") and not p.stem.startswith("bench")} | {"attention_block"}
COLUMNS = ["kernel", "model", "dtype", "size", "impl", "time_us", "graph_us", "bytes", "gbps", "graph_gbps",
           "peak_gbps", "pct_peak", "graph_pct_peak", "flops", "tflops", "vs_ref", "device", "note"]
PNG = b"\x89PNG\r\n\x1a\n"


def run_bench(*args: str) -> subprocess.CompletedProcess:
    """python -m nano_spec_kernels.bench ARGS from the repository root, with the checkout's kernels first."""
    path = os.pathsep.join(filter(None, [str(ROOT / "kernels"), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "nano_spec_kernels.bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=path))


def read_csv(path: Path) -> tuple[list, list]:
    """(header, rows as dicts)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kernel_bench")
    assert bench.main(["--quick", "--out", str(out)]) == 0
    return out


def test_the_bench_covers_every_kernel():
    assert len(KERNELS) == 11, sorted(KERNELS)  # the ten kernel files and attention_block


def test_quick_writes_a_csv_and_a_png_per_kernel(quick):
    assert {p.stem for p in quick.glob("*.csv")} == KERNELS
    assert {p.stem for p in quick.glob("*.png")} == KERNELS
    for kernel in KERNELS:
        assert (quick / f"{kernel}.png").read_bytes()[:8] == PNG, kernel


def test_the_csv_has_the_documented_columns(quick):
    documented = set(re.findall(r"`(\w+)`", (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")))
    assert set(COLUMNS) <= documented, sorted(set(COLUMNS) - documented)
    for kernel in sorted(KERNELS):
        header, rows = read_csv(quick / f"{kernel}.csv")
        assert header == COLUMNS, kernel
        assert {r["kernel"] for r in rows} == {kernel}
        assert {r["dtype"] for r in rows} == {"fp32", "bf16"}, kernel
        impls = {r["impl"] for r in rows}
        assert "ref" in impls and any(i.startswith("triton") for i in impls), (kernel, impls)
        for impl in impls:  # a sweep: at least two sizes of every implementation in each dtype
            for dtype in ("fp32", "bf16"):
                assert len({r["size"] for r in rows if (r["impl"], r["dtype"]) == (impl, dtype)}) >= 2, (kernel, impl)


def test_rates_follow_from_bytes_and_time(quick):
    for kernel in sorted(KERNELS):
        rows = read_csv(quick / f"{kernel}.csv")[1]
        ref = {(r["model"], r["dtype"], r["size"]): float(r["time_us"]) for r in rows if r["impl"] == "ref"}
        for r in rows:
            nbytes, t = int(r["bytes"]), float(r["time_us"])
            assert nbytes > 0 and t > 0, r
            assert math.isclose(float(r["gbps"]), nbytes / (t * 1e-6) / 1e9, rel_tol=1e-4), r
            assert math.isclose(float(r["vs_ref"]), ref[r["model"], r["dtype"], r["size"]] / t, rel_tol=1e-4), r
            assert r["graph_us"] == r["graph_gbps"] == "" or float(r["graph_us"]) > 0, r  # graphs: CUDA only
            if r["peak_gbps"]:
                assert math.isclose(float(r["pct_peak"]), 100 * float(r["gbps"]) / float(r["peak_gbps"]),
                                    rel_tol=1e-4), r
            else:
                assert r["pct_peak"] == "", r  # no peak known (a CPU): no % of peak
            if kernel in ("attention_prefill", "mamba_scan"):  # where flops matter
                assert math.isclose(float(r["tflops"]), int(r["flops"]) / (t * 1e-6) / 1e12, rel_tol=1e-4), r
            else:
                assert r["flops"] == r["tflops"] == "", r


def test_bytes_are_the_kernels_formula(quick):
    """An rmsnorm row, counted by hand: x, the residual, y and h of rows x D, and the weight (D,), 4 bytes each."""
    rows = read_csv(quick / "rmsnorm.csv")[1]
    row = next(r for r in rows if (r["size"], r["dtype"]) == ("D=64 rows=4", "fp32"))
    assert int(row["bytes"]) == (4 * 4 * 64 + 64) * 4 == sum(rmsnorm_bytes(4, 64, 4, True).values())


def test_kernels_and_peak_pick_what_runs(tmp_path):
    run = run_bench("--quick", "--kernels", "rmsnorm,gather_rows", "--dtypes", "fp32", "--peak-gbps", "50",
                    "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gather_rows.csv", "gather_rows.png", "rmsnorm.csv",
                                                          "rmsnorm.png"]
    assert re.findall(r"^== (\w+)$", run.stdout, re.M) == ["rmsnorm", "gather_rows"]
    for r in read_csv(tmp_path / "rmsnorm.csv")[1]:
        assert r["dtype"] == "fp32" and float(r["peak_gbps"]) == 50.0
        assert math.isclose(float(r["pct_peak"]), 2 * float(r["gbps"]), rel_tol=1e-4), r


def test_help_and_bad_names():
    run = run_bench("--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: python -m nano_spec_kernels.bench")
    for flag in ("--quick", "--kernels", "--out", "--peak-gbps", "--predict", *sorted(KERNELS)):
        assert flag in run.stdout, flag
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--kernels", "rmsnorm,nope"])
    assert exit_.value.code == 2


def test_without_matplotlib_the_csvs_are_still_written(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib"
                        else find_spec(name, *a))
    assert bench.main(["--quick", "--kernels", "gather_rows", "--dtypes", "fp32", "--out", str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["gather_rows.csv"]
    assert "plots: need matplotlib (pip install 'nano-spec[bench]')" in capsys.readouterr().out
