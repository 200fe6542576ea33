"""Bandwidth of the decode-side kernels: attention_verify and verdict_greedy.

Both are memory bound, so each row reports GB/s = bytes that must move / time, with
the bytes written out below (every input read once, every output written once), the
% of the device's HBM peak, and the speed ratio to the torch reference. On CUDA the
Triton kernel is timed (bf16 attention); on the CPU only the references are (the
interpreter's timings mean nothing), on a smaller subset of shapes.

    pytest tests/bench/bench_attention.py -m bench -s [--benchmark-enable]
    python -m tests.bench.bench_attention
"""
import itertools

import pytest
import torch

from nano_spec_kernels.attention_verify import (attention_verify, attention_verify_bytes, attention_verify_ref,
                                               verify_meta)
from nano_spec_kernels.common import sm_count, split_plan
from nano_spec_kernels.verdict_greedy import row_stats_meta, verdict_greedy, verdict_greedy_bytes, verdict_greedy_ref

try:
    from tests.bench.util import HEADER, report_row, time_ms
except ImportError:  # under pytest, tests/ itself is on sys.path
    from bench.util import HEADER, report_row, time_ms

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# granite-4.0-h-1b-like attention layer: 12 query heads over 4 KV heads of 128
HQ, HKV, DH = 12, 4, 128
ATTN_DTYPE = torch.bfloat16 if CUDA else torch.float32
REPS = 20 if CUDA else 3

if CUDA:
    VERIFY_SHAPES = list(itertools.product([512, 2048, 8192], [1, 8, 64], [1, 3, 5]))  # (seq_len, B, K)
    GREEDY_SHAPES = list(itertools.product([4096, 131072], [1, 8, 64], [1, 5]))  # (V, B, K)
else:
    VERIFY_SHAPES = list(itertools.product([512, 2048], [1, 8], [1, 5]))
    GREEDY_SHAPES = list(itertools.product([4096, 131072], [1, 8], [1, 5]))


def verify_bytes(seq_len: int, Bsz: int, K: int) -> int:
    """attention_verify_bytes (the formula beside the kernel) at this device's split count: the seq_len old cache
    rows of K and V read, the new q, k, v read, the K new K/V rows and o written, the partials of a split."""
    meta = verify_meta(HQ, HKV, DH, K, ATTN_DTYPE, CUDA)
    splits = split_plan(seq_len + K, meta["BLOCK_N"], Bsz * HKV, sm_count(torch.device(DEVICE)))[1]
    return sum(attention_verify_bytes(Bsz, K, HQ, HKV, DH, seq_len, ATTN_DTYPE.itemsize, splits, rope=True).values())


def greedy_bytes(V: int, Bsz: int, K: int, elem: int) -> int:
    """verdict_greedy_bytes at this device's split count: the logits read once, the partials, ids and picks."""
    block = row_stats_meta(V, CUDA)["BLOCK_V"]
    splits = split_plan(V, block, Bsz * K, sm_count(torch.device(DEVICE)))[1]
    return sum(verdict_greedy_bytes(Bsz, K, V, elem, splits).values())


def _verify_inputs(seq_len: int, Bsz: int, K: int):
    L = seq_len + K
    q = torch.randn(Bsz, K, HQ, DH, device=DEVICE, dtype=ATTN_DTYPE)
    k = torch.randn(Bsz, K, HKV, DH, device=DEVICE, dtype=ATTN_DTYPE)
    v = torch.randn(Bsz, K, HKV, DH, device=DEVICE, dtype=ATTN_DTYPE)
    k_cache = torch.randn(Bsz, L, HKV, DH, device=DEVICE, dtype=ATTN_DTYPE)
    v_cache = torch.randn(Bsz, L, HKV, DH, device=DEVICE, dtype=ATTN_DTYPE)
    slots = torch.arange(Bsz, device=DEVICE)
    lens = torch.full((Bsz,), seq_len, device=DEVICE)
    return q, k, v, k_cache, v_cache, slots, lens, DH**-0.5, 10000.0


def run_attention_verify(seq_len: int, Bsz: int, K: int):
    """Time one shape; returns (the timed call, the printed row)."""
    args = _verify_inputs(seq_len, Bsz, K)
    ref_ms = time_ms(lambda: attention_verify_ref(*args), reps=REPS)
    fn = (lambda: attention_verify(*args)) if CUDA else (lambda: attention_verify_ref(*args))
    ms = time_ms(fn, reps=REPS) if CUDA else ref_ms
    name = "attention_verify" if CUDA else "attention_verify_ref"
    row = report_row(name, f"L={seq_len} B={Bsz} K={K}", ms, verify_bytes(seq_len, Bsz, K), ref_ms if CUDA else None)
    return fn, row


def _greedy_inputs(V: int, Bsz: int, K: int):
    logits = torch.randn(Bsz, K, V, device=DEVICE)
    drafts = torch.randint(0, V, (Bsz, K - 1), device=DEVICE)
    nd = torch.full((Bsz,), K - 1, device=DEVICE)
    return logits, drafts, nd


def run_verdict_greedy(V: int, Bsz: int, K: int):
    args = _greedy_inputs(V, Bsz, K)
    ref_ms = time_ms(lambda: verdict_greedy_ref(*args), reps=REPS)
    fn = (lambda: verdict_greedy(*args)) if CUDA else (lambda: verdict_greedy_ref(*args))
    ms = time_ms(fn, reps=REPS) if CUDA else ref_ms
    name = "verdict_greedy" if CUDA else "verdict_greedy_ref"
    row = report_row(name, f"V={V} B={Bsz} K={K}", ms, greedy_bytes(V, Bsz, K, 4), ref_ms if CUDA else None)
    return fn, row


@pytest.mark.bench
@pytest.mark.parametrize("seq_len, Bsz, K", VERIFY_SHAPES, ids=[f"L{s}-B{b}-K{k}" for s, b, k in VERIFY_SHAPES])
def test_bench_attention_verify(benchmark, seq_len, Bsz, K):
    fn, _ = run_attention_verify(seq_len, Bsz, K)
    benchmark(fn)


@pytest.mark.bench
@pytest.mark.parametrize("V, Bsz, K", GREEDY_SHAPES, ids=[f"V{v}-B{b}-K{k}" for v, b, k in GREEDY_SHAPES])
def test_bench_verdict_greedy(benchmark, V, Bsz, K):
    fn, _ = run_verdict_greedy(V, Bsz, K)
    benchmark(fn)


def main():
    header = HEADER
    print(f"device: {torch.cuda.get_device_name() if CUDA else 'cpu (references only)'}")
    print(header)
    for shape in VERIFY_SHAPES:
        run_attention_verify(*shape)
    print(header)
    for shape in GREEDY_SHAPES:
        run_verdict_greedy(*shape)


if __name__ == "__main__":
    main()
