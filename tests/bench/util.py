"""Timing and the bandwidth table shared by the kernel benchmarks.

GB/s = bytes that must move / time, where "bytes that must move" is the formula
beside each kernel (`<op>_bytes`: inputs read once + outputs written once), the
same the roofline of `python -m tests.bench --predict` uses. On CUDA the Triton
kernel is timed with triton.testing.do_bench and printed beside its roofline time
(bytes / the device's HBM peak); on the CPU only the torch reference is timed
(interpreter timings mean nothing).
"""
import time

import torch

HBM_PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def peak_gbps():
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in HBM_PEAK_GBPS.items() if k in name), None)


def time_ms(fn, reps: int = 20) -> float:
    """Median milliseconds per call of fn()."""
    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1e3 * times[len(times) // 2]


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


HEADER = (f"{'kernel':<18} {'shape':<34} {'time':>13} {'roofline':>12} {'bandwidth':>14} {'% peak':>7} "
          f"{'vs ref':>8}")


def report_row(kernel: str, shape: str, ms: float, bytes_moved: int, ref_ms: float | None = None) -> str:
    """One printed table row: kernel, shape, time, the roofline time (bytes / HBM peak, CUDA), GB/s, % of peak
    (= roofline / time), ratio to the reference."""
    gbps = bytes_moved / (ms * 1e-3) / 1e9
    peak = peak_gbps()
    pct = f"{100 * gbps / peak:6.1f}%" if peak else "    n/a"
    roof = f"{bytes_moved / peak / 1e3:9.1f} us" if peak else f"{'n/a':>12}"
    ratio = f"{ref_ms / ms:7.2f}x" if ref_ms else "      -"
    row = f"{kernel:<18} {shape:<34} {ms * 1e3:10.1f} us {roof} {gbps:9.1f} GB/s {pct} {ratio}"
    print(row)
    return row
