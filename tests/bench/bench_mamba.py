"""Bandwidth of the Mamba kernels: mamba_verify, commit_state, mamba_scan, rmsnorm.

Decode-side Mamba work is memory bound: the (H, P, N) fp32 state of every layer is
read and written each step, and the verify also writes K stash states. Each row
reports GB/s = bytes that must move / time, with the bytes written out below
(every input read once, every output written once), the % of the device's HBM
peak, and the speed ratio to the torch reference. On CUDA the Triton kernel is
timed (bf16 activations, fp32 state); on the CPU only the references are (the
interpreter's timings mean nothing), on smaller shapes.

    pytest tests/bench/bench_mamba.py -m bench -s [--benchmark-enable]
    python -m tests.bench.bench_mamba
"""
import pytest
import torch

from nano_spec_kernels.commit_state import commit_state, commit_state_bytes, commit_state_ref
from nano_spec_kernels.mamba_scan import mamba_scan, mamba_scan_ref
from nano_spec_kernels.mamba_verify import mamba_verify, mamba_verify_bytes, mamba_verify_ref
from nano_spec_kernels.rmsnorm import rmsnorm, rmsnorm_bytes, rmsnorm_ref

try:
    from tests.bench.util import HEADER, report_row, time_ms
except ImportError:  # under pytest, tests/ itself is on sys.path
    from bench.util import HEADER, report_row, time_ms

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
ACT = torch.bfloat16 if CUDA else torch.float32  # activations and conv state; the ssm state is always fp32
REPS = 20 if CUDA else 3

# granite-4.0-h-1b-like Mamba layer on CUDA (48 heads of 64, state 128, one group, conv width 4);
# fewer heads on the CPU so the references run in seconds
H, P, N, G, W = (48, 64, 128, 1, 4) if CUDA else (16, 64, 128, 1, 4)
C = H * P + 2 * G * N
D_MODEL = 1536 if CUDA else 768
L_MAMBA = 36 if CUDA else 4  # Mamba layers committed by one commit_state launch

if CUDA:
    VERIFY_SHAPES = [(1, 4), (32, 4), (256, 4)] + [(32, k) for k in (1, 2, 3, 5)]  # (B, K)
    COMMIT_SHAPES = [(1, 4), (32, 4), (256, 4)]
    SCAN_T = [512, 2048]
    NORM_ROWS = [1, 256, 8192]
else:
    VERIFY_SHAPES = [(1, 4), (32, 4)] + [(1, k) for k in (1, 2, 3, 5)]
    COMMIT_SHAPES = [(1, 4), (32, 4)]
    SCAN_T = [64]
    NORM_ROWS = [1, 256]


# ---------------------------------------------------------------- bytes that must move

def verify_bytes(Bsz: int, K: int, act: int = ACT.itemsize, shape=None) -> dict:
    """One verify step of one layer (mamba_verify_bytes, the formula beside the kernel), grouped into what is
    read and what each output costs. The ssm stash holds K full states per sequence (the state after every row,
    so that any accepted prefix can be committed by a copy): it is most of the traffic and grows with K; that is
    the cost a later 'replay' design (stash the K rows' inputs, recompute the accepted state at commit) will attack."""
    H, P, N, G, W = shape or (globals()["H"], globals()["P"], globals()["N"], globals()["G"], globals()["W"])
    b = mamba_verify_bytes(Bsz, K, H, P, N, G, W, act)
    return dict(
        read=sum(b[k] for k in ("xBC", "dt", "conv_state read", "ssm_state read", "weights", "slot_ids",
                                "conv_stash read")),
        ssm_stash=b["ssm_stash"],
        ssm_state=b["ssm_state written"],
        conv=b["conv_stash"] + b["conv_state written"],
        y=b["y"],
    )


def commit_bytes(Bsz: int, L: int, K: int, act: int = ACT.itemsize) -> int:
    """Every row commits (worst case): commit_state_bytes, the stash row read and the live state written."""
    return sum(commit_state_bytes(L, Bsz, K, H, P, N, C, W, act).values())


def scan_bytes(T: int, act: int = ACT.itemsize) -> int:
    """xBC and dt read, y written, the final state and conv window written (parameters included)."""
    return T * (C + H) * act + T * H * P * act + H * P * N * 4 + C * (W - 1) * act + (C * W + C) * act + 3 * H * 4


# ---------------------------------------------------------------- runners

def _layer():
    return dict(conv_weight=torch.randn(C, W, device=DEVICE, dtype=ACT) / 2,
                conv_bias=torch.randn(C, device=DEVICE, dtype=ACT) * 0.1,
                dt_bias=torch.rand(H, device=DEVICE) - 2, A_log=torch.log(torch.rand(H, device=DEVICE) * 15 + 1),
                D=torch.randn(H, device=DEVICE))


def _timed(name: str, shape: str, kernel, ref, nbytes: int):
    """Time the reference, and the kernel on CUDA; print one row; return the timed call."""
    ref_ms = time_ms(ref, reps=REPS)
    if CUDA:
        ms = time_ms(kernel, reps=REPS)
        report_row(name, shape, ms, nbytes, ref_ms)
        return kernel
    report_row(name.split("[")[0] + "_ref", shape, ref_ms, nbytes)
    return ref


def run_mamba_verify(Bsz: int, K: int):
    prm = _layer()
    S = Bsz
    xBC = torch.randn(Bsz, K, C, device=DEVICE, dtype=ACT)
    dt = torch.randn(Bsz, K, H, device=DEVICE, dtype=ACT)
    conv_state = torch.randn(S, C, W - 1, device=DEVICE, dtype=ACT)
    ssm_state = torch.randn(S, H, P, N, device=DEVICE)
    slots = torch.randperm(S, device=DEVICE)
    ssm_stash = torch.empty(Bsz, K, H, P, N, device=DEVICE)
    conv_stash = torch.empty(Bsz, C, W - 1 + K, device=DEVICE, dtype=ACT)
    args = (xBC, dt, conv_state, ssm_state, slots, prm["conv_weight"], prm["conv_bias"], prm["dt_bias"],
            prm["A_log"], prm["D"], ssm_stash, conv_stash, G)
    nbytes = sum(verify_bytes(Bsz, K).values())
    return _timed("mamba_verify", f"B={Bsz} K={K} H={H} P={P} N={N}", lambda: mamba_verify(*args),
                  lambda: mamba_verify_ref(*args), nbytes)


def run_commit_state(Bsz: int, K: int):
    L = L_MAMBA
    ssm_state = torch.randn(L, Bsz, H, P, N, device=DEVICE)
    conv_state = torch.randn(L, Bsz, C, W - 1, device=DEVICE, dtype=ACT)
    ssm_stash = torch.randn(L, Bsz, K, H, P, N, device=DEVICE)
    conv_stash = torch.randn(L, Bsz, C, W - 1 + K, device=DEVICE, dtype=ACT)
    slots = torch.randperm(Bsz, device=DEVICE)
    na = torch.randint(0, K - 1, (Bsz,), device=DEVICE)  # every row commits (na < K-1)
    active = torch.ones(Bsz, dtype=torch.bool, device=DEVICE)
    args = (ssm_state, conv_state, ssm_stash, conv_stash, slots, na, active)
    return _timed("commit_state", f"L={L} B={Bsz} K={K}", lambda: commit_state(*args),
                  lambda: commit_state_ref(*args), commit_bytes(Bsz, L, K))


def run_mamba_scan(T: int):
    prm = _layer()
    xBC = torch.randn(T, C, device=DEVICE, dtype=ACT)
    dt = torch.randn(T, H, device=DEVICE, dtype=ACT)
    args = (xBC, dt, prm["conv_weight"], prm["conv_bias"], prm["dt_bias"], prm["A_log"], prm["D"], G, P)
    nbytes = scan_bytes(T)
    fn = _timed("mamba_scan[chunk]", f"T={T} H={H} P={P} N={N}", lambda: mamba_scan(*args, method="chunked"),
                lambda: mamba_scan_ref(*args), nbytes)
    if CUDA:  # the recurrent kernel, for the chunked/recurrent ratio
        _timed("mamba_scan[rec]", f"T={T} H={H} P={P} N={N}", lambda: mamba_scan(*args, method="recurrent"),
               lambda: mamba_scan_ref(*args), nbytes)
    return fn


def run_rmsnorm(rows: int):
    x = torch.randn(rows, D_MODEL, device=DEVICE, dtype=ACT)
    res = torch.randn(rows, D_MODEL, device=DEVICE, dtype=ACT)
    w = torch.randn(D_MODEL, device=DEVICE, dtype=ACT)
    return _timed("rmsnorm+residual", f"rows={rows} D={D_MODEL}", lambda: rmsnorm(x, w, 1e-5, res, 0.5),
                  lambda: rmsnorm_ref(x, w, 1e-5, res, 0.5),
                  sum(rmsnorm_bytes(rows, D_MODEL, ACT.itemsize, True).values()))


TABLE_SHAPE = (48, 64, 128, 1, 4)  # granite-4.0-h-1b-like layer, whatever the device


def print_bytes_per_step(ks=range(1, 9), shape=TABLE_SHAPE, act=2):
    """Bytes written per verify step per layer per sequence, as a function of K (a formula, not a timing)."""
    mib = 2.0 ** 20
    H, P, N, G, W = shape
    print(f"\nbytes written per verify step per layer per sequence (H={H} P={P} N={N} G={G} W={W}, "
          f"activations {act} B, state fp32)")
    print(f"{'K':>3} {'ssm_stash (K states)':>21} {'ssm_state':>10} {'conv stash+state':>17} {'y':>9} "
          f"{'total written':>14} {'read':>9}")
    for K in ks:
        b = verify_bytes(1, K, act, shape)
        written = b["ssm_stash"] + b["ssm_state"] + b["conv"] + b["y"]
        print(f"{K:>3} {b['ssm_stash'] / mib:>17.3f} MiB {b['ssm_state'] / mib:>6.3f} MiB {b['conv'] / 1024:>13.1f} KiB "
              f"{b['y'] / 1024:>5.1f} KiB {written / mib:>10.3f} MiB {b['read'] / mib:>5.3f} MiB")


# ---------------------------------------------------------------- pytest entries

@pytest.mark.bench
@pytest.mark.parametrize("Bsz, K", VERIFY_SHAPES, ids=[f"B{b}-K{k}" for b, k in VERIFY_SHAPES])
def test_bench_mamba_verify(benchmark, Bsz, K):
    benchmark(run_mamba_verify(Bsz, K))


@pytest.mark.bench
@pytest.mark.parametrize("Bsz, K", COMMIT_SHAPES, ids=[f"B{b}-K{k}" for b, k in COMMIT_SHAPES])
def test_bench_commit_state(benchmark, Bsz, K):
    benchmark(run_commit_state(Bsz, K))


@pytest.mark.bench
@pytest.mark.parametrize("T", SCAN_T, ids=[f"T{t}" for t in SCAN_T])
def test_bench_mamba_scan(benchmark, T):
    benchmark(run_mamba_scan(T))


@pytest.mark.bench
@pytest.mark.parametrize("rows", NORM_ROWS, ids=[f"rows{r}" for r in NORM_ROWS])
def test_bench_rmsnorm(benchmark, rows):
    benchmark(run_rmsnorm(rows))


@pytest.mark.bench
def test_bench_bytes_per_step_table():
    print_bytes_per_step()


def main():
    header = HEADER
    print(f"device: {torch.cuda.get_device_name() if CUDA else 'cpu (references only)'}")
    for runner, shapes in ((run_mamba_verify, VERIFY_SHAPES), (run_commit_state, COMMIT_SHAPES),
                           (run_mamba_scan, [(t,) for t in SCAN_T]), (run_rmsnorm, [(r,) for r in NORM_ROWS])):
        print(header)
        for shape in shapes:
            runner(*shape)
    print_bytes_per_step()


if __name__ == "__main__":
    main()
