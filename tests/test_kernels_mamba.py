"""Mamba kernels vs their plain-torch references (fp32; the Triton interpreter on CPU).

Every Triton launcher must equal its `_ref` over awkward sizes (T = 1, 63, 200;
K = 1..5; G = 1, 2; P and N not powers of two; W = 3, 4; slots out of order) and
leave every slot, stash row and layer it must not touch bit-for-bit unchanged.
Shapes stay small: the interpreter runs one numpy op per Triton op per program.
"""
import pytest
import torch

from nano_spec_kernels.commit_state import commit_state, commit_state_ref
from nano_spec_kernels.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_ref
from nano_spec_kernels.mamba_scan import mamba_scan, mamba_scan_ref
from nano_spec_kernels.mamba_verify import mamba_verify, mamba_verify_ref
from nano_spec_kernels.rmsnorm import rmsnorm, rmsnorm_ref
from helpers import assert_close, assert_refuses, assert_unchanged

INF = float("inf")
S = 7  # cache slots
SLOTS = [3, 0, 5]  # out of order, with gaps: slots 1, 2, 4, 6 must stay untouched

MAX_ERR: dict[str, tuple[float, float]] = {}  # kernel -> (max abs error, max error / max(1, |ref|))


def check(kernel: str, name: str, ref, out):
    """assert_close, and remember the largest error seen per kernel (printed at the end)."""
    err = assert_close(f"{kernel}.{name}", ref, out)
    scaled = err / max(1.0, ref.detach().abs().max().item()) if ref.numel() else 0.0
    a, r = MAX_ERR.get(kernel, (0.0, 0.0))
    MAX_ERR[kernel] = (max(a, err), max(r, scaled))


@pytest.fixture(scope="module", autouse=True)
def _report_max_errors():
    yield
    print("\nlargest kernel-vs-reference error (max abs, and max abs / max(1, max|ref|); the bound is 1e-4):")
    for k, (a, r) in sorted(MAX_ERR.items()):
        print(f"  {k:<18} {a:.3e}  {r:.3e}")


def make_layer(H, P, N, G, W, bias=True, device="cpu"):
    """Parameters of one Mamba2 layer with realistic ranges (A in [-16, -1], dt around 0.01 .. 1)."""
    C = H * P + 2 * G * N
    return dict(
        conv_weight=torch.randn(C, W, device=device) / W ** 0.5,
        conv_bias=torch.randn(C, device=device) * 0.1 if bias else None,
        dt_bias=torch.rand(H, device=device) * 4 - 3,
        A_log=torch.log(torch.rand(H, device=device) * 15 + 1),
        D=torch.randn(H, device=device),
    )


def slot_ids(Bsz, device="cpu"):
    return torch.tensor(SLOTS[:Bsz], device=device)


# ---------------------------------------------------------------- mamba_verify

def run_verify(fn, xBC, dt, conv_state, ssm_state, slots, prm, G, dt_limit=(0.0, INF)):
    """Call fn on copies of the states; returns (y, conv_state, ssm_state, ssm_stash, conv_stash)."""
    Bsz, K, C = xBC.shape
    _, H, P, N = ssm_state.shape
    conv_state, ssm_state = conv_state.clone(), ssm_state.clone()
    ssm_stash = torch.full((Bsz, K, H, P, N), float("nan"), device=xBC.device)  # NaN: unwritten rows show
    conv_stash = torch.full((Bsz, C, conv_state.shape[-1] + K), float("nan"), device=xBC.device)
    y = fn(xBC, dt, conv_state, ssm_state, slots, prm["conv_weight"], prm["conv_bias"], prm["dt_bias"],
           prm["A_log"], prm["D"], ssm_stash, conv_stash, G, dt_limit)
    return y, conv_state, ssm_state, ssm_stash, conv_stash


VERIFY_CASES = [
    # id, (Bsz, K, H, P, N, G, W), bias, dt_limit
    ("K1-decode", (3, 1, 4, 12, 10, 2, 4), True, (0.0, INF)),
    ("K2", (3, 2, 4, 12, 10, 2, 4), True, (0.0, INF)),
    ("K3", (3, 3, 4, 12, 10, 2, 4), True, (0.0, INF)),
    ("K4", (3, 4, 4, 12, 10, 2, 4), True, (0.0, INF)),
    ("K5", (3, 5, 4, 12, 10, 2, 4), True, (0.0, INF)),
    ("G1-P48-N24-K4", (2, 4, 2, 48, 24, 1, 4), True, (0.0, INF)),
    ("W3-nobias-K3", (3, 3, 2, 12, 10, 1, 3), False, (0.0, INF)),
    ("dt-clamp-K3", (3, 3, 4, 12, 10, 2, 4), True, (0.05, 0.3)),
]


@pytest.mark.parametrize("shape,bias,dt_limit", [c[1:] for c in VERIFY_CASES], ids=[c[0] for c in VERIFY_CASES])
def test_mamba_verify_matches_ref(shape, bias, dt_limit, device):
    Bsz, K, H, P, N, G, W = shape
    C = H * P + 2 * G * N
    prm = make_layer(H, P, N, G, W, bias, device)
    # xBC and dt as strided views into one in_proj-like output (unit stride on the last dim only)
    zxbcdt = torch.randn(Bsz, K, H * P + C + H + 3, device=device)
    xBC, dt = zxbcdt[..., H * P:H * P + C], zxbcdt[..., H * P + C:H * P + C + H]
    conv_state = torch.randn(S, C, W - 1, device=device)
    ssm_state = torch.randn(S, H, P, N, device=device)
    slots = slot_ids(Bsz, device)

    ref = run_verify(mamba_verify_ref, xBC, dt, conv_state, ssm_state, slots, prm, G, dt_limit)
    out = run_verify(mamba_verify, xBC, dt, conv_state, ssm_state, slots, prm, G, dt_limit)
    for name, r, o in zip(("y", "conv_state", "ssm_state", "ssm_stash", "conv_stash"), ref, out):
        check("mamba_verify", name, r, o)
    untouched = [s for s in range(S) if s not in SLOTS[:Bsz]]
    assert_unchanged("conv_state of other slots", conv_state[untouched], out[1][untouched])
    assert_unchanged("ssm_state of other slots", ssm_state[untouched], out[2][untouched])
    if dt_limit[1] < INF:  # the clamp must bind for this case to test anything
        assert (torch.nn.functional.softplus(dt + prm["dt_bias"]) > dt_limit[1]).any()
        assert (torch.nn.functional.softplus(dt + prm["dt_bias"]) < dt_limit[0]).any()


def test_mamba_verify_layer_view_of_stacked_cache(device):
    """The model passes ssm_state[l] of a stacked (L, S, H, P, N) cache: other layers stay untouched."""
    Bsz, K, H, P, N, G, W = 2, 3, 2, 12, 10, 1, 4
    C = H * P + 2 * G * N
    prm = make_layer(H, P, N, G, W, device=device)
    xBC, dt = torch.randn(Bsz, K, C, device=device), torch.randn(Bsz, K, H, device=device)
    conv_all, ssm_all = torch.randn(3, S, C, W - 1, device=device), torch.randn(3, S, H, P, N, device=device)
    conv0, ssm0 = conv_all.clone(), ssm_all.clone()
    slots = slot_ids(Bsz, device)
    ssm_stash, conv_stash = torch.empty(Bsz, K, H, P, N, device=device), torch.empty(Bsz, C, W - 1 + K, device=device)
    y = mamba_verify(xBC, dt, conv_all[1], ssm_all[1], slots, prm["conv_weight"], prm["conv_bias"], prm["dt_bias"],
                     prm["A_log"], prm["D"], ssm_stash, conv_stash, G)
    ref = run_verify(mamba_verify_ref, xBC, dt, conv0[1], ssm0[1], slots, prm, G)
    check("mamba_verify", "y(layer view)", ref[0], y)
    check("mamba_verify", "ssm_state(layer view)", ref[2], ssm_all[1])
    check("mamba_verify", "conv_state(layer view)", ref[1], conv_all[1])
    for l in (0, 2):
        assert_unchanged(f"ssm_state layer {l}", ssm0[l], ssm_all[l])
        assert_unchanged(f"conv_state layer {l}", conv0[l], conv_all[l])


@pytest.mark.parametrize("K", [2, 5], ids=lambda k: f"K{k}")
def test_mamba_verify_k_rows_equal_k_single_steps(K, device):
    """One verify over K rows = K decode steps (K = 1): y, stash rows = states after each step, live state."""
    Bsz, H, P, N, G, W = 3, 4, 12, 10, 2, 4
    C = H * P + 2 * G * N
    prm = make_layer(H, P, N, G, W, device=device)
    xBC, dt = torch.randn(Bsz, K, C, device=device), torch.randn(Bsz, K, H, device=device)
    conv_state, ssm_state = torch.randn(S, C, W - 1, device=device), torch.randn(S, H, P, N, device=device)
    slots = slot_ids(Bsz, device)
    y, conv_k, ssm_k, ssm_stash, conv_stash = run_verify(mamba_verify, xBC, dt, conv_state, ssm_state, slots, prm, G)

    cs, ss = conv_state, ssm_state
    for j in range(K):
        y1, cs, ss, stash1, _ = run_verify(mamba_verify, xBC[:, j:j + 1], dt[:, j:j + 1], cs, ss, slots, prm, G)
        check("mamba_verify", f"y row {j} (K single steps)", y1[:, 0], y[:, j])
        check("mamba_verify", f"stash row {j} (K single steps)", stash1[:, 0], ssm_stash[:, j])
    check("mamba_verify", "ssm_state (K single steps)", ss, ssm_k)
    check("mamba_verify", "conv_state (K single steps)", cs, conv_k)
    # conv_stash = window before the step followed by the K new inputs
    assert_unchanged("conv_stash old window", conv_state[slots], conv_stash[:, :, :W - 1])
    assert_unchanged("conv_stash new inputs", xBC.transpose(1, 2), conv_stash[:, :, W - 1:])


def sequential_verify_ref(xBC, dt, conv_state, ssm_state, slots, conv_weight, conv_bias, dt_bias, A_log, D,
                          ssm_stash, conv_stash, G, dt_limit=(0.0, INF)):
    """The K rows one at a time through ssm_step_ref: the form mamba_verify_ref must equal bit for bit."""
    from nano_spec_kernels.common import conv_silu_ref, mamba_dt_ref, split_xbc, ssm_step_ref

    K, (H, P) = xBC.shape[1], ssm_state.shape[1:3]
    window = torch.cat([conv_state[slots], xBC.transpose(1, 2)], dim=-1)
    conv_stash.copy_(window)
    x, B, Cm = split_xbc(conv_silu_ref(window, conv_weight, conv_bias), H, P, G)
    dt, A = mamba_dt_ref(dt, dt_bias, dt_limit), -torch.exp(A_log.float())
    state, ys = ssm_state[slots].float(), []
    for j in range(K):
        state, y = ssm_step_ref(state, x[:, j], B[:, j], Cm[:, j], dt[:, j], A, D)
        ssm_stash[:, j] = state
        ys.append(y)
    ssm_state[slots], conv_state[slots] = state, window[:, :, K:]
    return torch.stack(ys, dim=1)


@pytest.mark.parametrize("shape", [(3, 4, 4, 12, 10, 2, 4), (1, 1, 2, 7, 5, 1, 3), (2, 5, 6, 20, 33, 3, 4)],
                         ids=lambda s: "B{}-K{}-H{}-P{}-N{}-G{}-W{}".format(*s))
def test_vectorized_verify_ref_is_bitwise_the_sequential_form(shape):
    Bsz, K, H, P, N, G, W = shape
    C = H * P + 2 * G * N
    prm = make_layer(H, P, N, G, W)
    xBC, dt = torch.randn(Bsz, K, C), torch.randn(Bsz, K, H)
    conv_state, ssm_state = torch.randn(S, C, W - 1), torch.randn(S, H, P, N)
    slots = slot_ids(Bsz)
    vec = run_verify(mamba_verify_ref, xBC, dt, conv_state, ssm_state, slots, prm, G)
    seq = run_verify(sequential_verify_ref, xBC, dt, conv_state, ssm_state, slots, prm, G)
    for name, a, b in zip(("y", "conv_state", "ssm_state", "ssm_stash", "conv_stash"), seq, vec):
        assert_unchanged(f"mamba_verify_ref {name} vs sequential", a, b)


# ---------------------------------------------------------------- commit_state

COMMIT_CASES = [
    # id, K, na per sequence, active per sequence
    ("K1-noop", 1, [0, 0, 0], [True, True, True]),
    ("K3-mixed", 3, [0, 2, 1], [True, True, True]),
    ("K5-inactive", 5, [3, 0, 4], [True, False, True]),
]


@pytest.mark.parametrize("K,na,active", [c[1:] for c in COMMIT_CASES], ids=[c[0] for c in COMMIT_CASES])
def test_commit_state_matches_ref(K, na, active, device):
    L, Bsz, H, P, N, C, W = 2, 3, 3, 12, 10, 50, 4
    ssm_state, conv_state = torch.randn(L, S, H, P, N, device=device), torch.randn(L, S, C, W - 1, device=device)
    ssm_stash, conv_stash = torch.randn(L, Bsz, K, H, P, N, device=device), torch.randn(L, Bsz, C, W - 1 + K, device=device)
    slots = slot_ids(Bsz, device)
    na_t, act_t = torch.tensor(na, device=device), torch.tensor(active, device=device)
    stashes = (ssm_stash.clone(), conv_stash.clone())

    ref = (ssm_state.clone(), conv_state.clone())
    commit_state_ref(*ref, ssm_stash, conv_stash, slots, na_t, act_t)
    out = (ssm_state.clone(), conv_state.clone())
    commit_state(*out, ssm_stash, conv_stash, slots, na_t, act_t)
    check("commit_state", "ssm_state", ref[0], out[0])
    check("commit_state", "conv_state", ref[1], out[1])
    assert_unchanged("ssm_stash", stashes[0], ssm_stash)
    assert_unchanged("conv_stash", stashes[1], conv_stash)
    keep = [s for s in range(S) if s not in SLOTS[:Bsz]]
    keep += [SLOTS[b] for b in range(Bsz) if not active[b] or na[b] == K - 1]  # inactive, full accepts
    assert_unchanged("ssm_state of untouched slots", ssm_state[:, keep], out[0][:, keep])
    assert_unchanged("conv_state of untouched slots", conv_state[:, keep], out[1][:, keep])
    for b in range(Bsz):  # committed rows are an exact copy (a move, no math)
        if active[b] and na[b] < K - 1:
            assert_unchanged(f"seq {b} ssm row", ssm_stash[:, b, na[b]], out[0][:, SLOTS[b]])
            assert_unchanged(f"seq {b} conv window", conv_stash[:, b, :, na[b] + 1:na[b] + W], out[1][:, SLOTS[b]])


@pytest.mark.parametrize("K", [2, 4], ids=lambda k: f"K{k}")
def test_skipping_full_accepts_equals_committing_them(K):
    """After a verify the live state is the stash's last row, so a commit that skips full accepts (as
    the engine does) leaves the same bits as copying row na = K-1 back for every sequence."""
    Bsz, H, P, N, G, W = 3, 2, 12, 10, 1, 4
    C = H * P + 2 * G * N
    prm = make_layer(H, P, N, G, W)
    xBC, dt = torch.randn(Bsz, K, C), torch.randn(Bsz, K, H)
    y, conv_state, ssm_state, ssm_stash, conv_stash = run_verify(
        mamba_verify_ref, xBC, dt, torch.randn(S, C, W - 1), torch.randn(S, H, P, N), slot_ids(Bsz), prm, G)
    na = torch.tensor([K - 1, 0, K - 2])  # a full accept, a full rejection, one rejected draft
    skipped = (ssm_state[None].clone(), conv_state[None].clone())
    commit_state_ref(*skipped, ssm_stash[None], conv_stash[None], slot_ids(Bsz), na, torch.ones(Bsz, dtype=torch.bool))
    copied = (ssm_state[None].clone(), conv_state[None].clone())
    for b, n in enumerate(na.tolist()):  # naive: every sequence, full accepts included
        copied[0][0, SLOTS[b]] = ssm_stash[b, n]
        copied[1][0, SLOTS[b]] = conv_stash[b, :, n + 1:n + W]
    assert_unchanged("ssm_state", copied[0], skipped[0])
    assert_unchanged("conv_state", copied[1], skipped[1])


@pytest.mark.parametrize("K", [3, 4], ids=lambda k: f"K{k}")
def test_commit_after_verify_equals_verify_of_accepted_rows(K, device):
    """verify(K rows) + commit(na) = verify(na + 1 rows), for every na, both layers of a stacked cache."""
    L, Bsz, H, P, N, G, W = 2, 3, 2, 12, 10, 1, 4
    C = H * P + 2 * G * N
    prms = [make_layer(H, P, N, G, W, device=device) for _ in range(L)]
    xBC, dt = torch.randn(L, Bsz, K, C, device=device), torch.randn(L, Bsz, K, H, device=device)
    conv0, ssm0 = torch.randn(L, S, C, W - 1, device=device), torch.randn(L, S, H, P, N, device=device)
    slots = slot_ids(Bsz, device)
    na = torch.tensor([0, K - 1, K - 2], device=device)  # reject all, full accept, one rejected
    conv_state, ssm_state = conv0.clone(), ssm0.clone()
    ssm_stash, conv_stash = torch.empty(L, Bsz, K, H, P, N, device=device), torch.empty(L, Bsz, C, W - 1 + K, device=device)
    for l in range(L):
        p = prms[l]
        mamba_verify(xBC[l], dt[l], conv_state[l], ssm_state[l], slots, p["conv_weight"], p["conv_bias"], p["dt_bias"],
                     p["A_log"], p["D"], ssm_stash[l], conv_stash[l], G)
    commit_state(ssm_state, conv_state, ssm_stash, conv_stash, slots, na, torch.ones(Bsz, dtype=torch.bool, device=device))
    for l in range(L):
        for b in range(Bsz):
            n = int(na[b]) + 1
            _, cs, ss, _, _ = run_verify(mamba_verify, xBC[l, b:b + 1, :n], dt[l, b:b + 1, :n], conv0[l], ssm0[l],
                                         slots[b:b + 1], prms[l], G)
            check("commit_state", f"ssm l{l} b{b} (verify na+1)", ss[SLOTS[b]], ssm_state[l, SLOTS[b]])
            check("commit_state", f"conv l{l} b{b} (verify na+1)", cs[SLOTS[b]], conv_state[l, SLOTS[b]])


# ---------------------------------------------------------------- mamba_scan

SCAN_CASES = [
    # id, (T, H, P, N, G, W), bias, dt_limit
    ("T1", (1, 4, 12, 10, 2, 4), True, (0.0, INF)),
    ("T63-G2", (63, 4, 12, 10, 2, 4), True, (0.0, INF)),
    ("T200-G2", (200, 2, 12, 10, 2, 4), True, (0.0, INF)),
    ("T63-G1-P48-N24", (63, 2, 48, 24, 1, 4), True, (0.0, INF)),
    ("T63-W3-nobias", (63, 2, 12, 10, 1, 3), False, (0.0, INF)),
    ("T63-dt-clamp", (63, 2, 12, 10, 1, 4), True, (0.05, 0.3)),
    ("T2-W4", (2, 2, 12, 10, 1, 4), True, (0.0, INF)),  # T < W-1: zero-padded final window
]


@pytest.mark.parametrize("shape,bias,dt_limit", [c[1:] for c in SCAN_CASES], ids=[c[0] for c in SCAN_CASES])
def test_mamba_scan_recurrent_and_chunked_match_ref(shape, bias, dt_limit, device):
    T, H, P, N, G, W = shape
    C = H * P + 2 * G * N
    prm = make_layer(H, P, N, G, W, bias, device)
    zxbcdt = torch.randn(T, C + H + 5, device=device)  # strided views, as cut from in_proj's output
    xBC, dt = zxbcdt[:, :C], zxbcdt[:, C:C + H]
    args = (xBC, dt, prm["conv_weight"], prm["conv_bias"], prm["dt_bias"], prm["A_log"], prm["D"], G, P, dt_limit)
    ref = mamba_scan_ref(*args)
    rec = mamba_scan(*args, method="recurrent")
    chk = mamba_scan(*args, method="chunked")
    for name, r, a, b in zip(("y", "ssm_state", "conv_window"), ref, rec, chk):
        check("mamba_scan[rec]", name, r, a)
        check("mamba_scan[chunk]", name, r, b)
        check("mamba_scan[chunk]", f"{name} vs recurrent", a, b)


def test_mamba_scan_then_verify_equals_longer_scan(device):
    """Prefill T tokens, then verify K more from the scan's state and window = one scan over T + K."""
    T, K, H, P, N, G, W = 20, 3, 2, 12, 10, 1, 4
    C = H * P + 2 * G * N
    prm = make_layer(H, P, N, G, W, device=device)
    xBC, dt = torch.randn(T + K, C, device=device), torch.randn(T + K, H, device=device)
    args = (prm["conv_weight"], prm["conv_bias"], prm["dt_bias"], prm["A_log"], prm["D"], G, P)
    y_all, ssm_all, win_all = mamba_scan_ref(xBC, dt, *args)
    _, ssm_t, win_t = mamba_scan(xBC[:T], dt[:T], *args, method="chunked")
    conv_state, ssm_state = torch.zeros(S, C, W - 1, device=device), torch.zeros(S, H, P, N, device=device)
    conv_state[2], ssm_state[2] = win_t, ssm_t
    y, cs, ss, _, _ = run_verify(mamba_verify, xBC[None, T:], dt[None, T:], conv_state, ssm_state,
                                 torch.tensor([2], device=device), prm, G)
    check("mamba_verify", "y after scan", y_all[T:], y[0])
    check("mamba_verify", "ssm after scan", ssm_all, ss[2])
    check("mamba_verify", "conv after scan", win_all, cs[2])


# ---------------------------------------------------------------- norms

@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 40), (4, 100)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rmsnorm_matches_ref(shape, with_residual, device):
    D = shape[-1]
    x = torch.randn(*shape, device=device) * 3
    w = torch.randn(D, device=device)
    res = torch.randn(*shape, device=device) if with_residual else None
    y_ref, h_ref = rmsnorm_ref(x, w, 1e-5, res, 0.22)
    y, h = rmsnorm(x, w, 1e-5, res, 0.22)
    check("rmsnorm", "y", y_ref, y)
    check("rmsnorm", "h", h_ref, h)
    if res is None:
        assert h is x  # like the reference: h is the input itself


def test_rmsnorm_strided_rows(device):
    """Rows of a wider buffer (unit last-dim stride, row stride > D)."""
    big = torch.randn(6, 64, device=device)
    x, res, w = big[:, :40], big[:, 10:50], torch.randn(40, device=device)
    for a, b in zip(rmsnorm_ref(x, w, 1e-6, res, 2.0), rmsnorm(x, w, 1e-6, res, 2.0)):
        check("rmsnorm", "strided", a, b)


@pytest.mark.parametrize("shape,group_size", [((4, 48), 12), ((4, 48), 48), ((2, 3, 40), 10)],
                         ids=["G4", "G1", "3d-G4"])
def test_gated_rmsnorm_matches_ref(shape, group_size, device):
    y, z = torch.randn(*shape, device=device), torch.randn(*shape, device=device) * 2
    w = torch.randn(shape[-1], device=device)
    check("gated_rmsnorm", "out", gated_rmsnorm_ref(y, z, w, group_size, 1e-5), gated_rmsnorm(y, z, w, group_size, 1e-5))


# ---------------------------------------------------------------- launcher checks

def _verify_inputs(device, **over):
    Bsz, K, H, P, N, G, W = 2, 2, 2, 12, 10, 1, 4
    C = H * P + 2 * G * N
    prm = make_layer(H, P, N, G, W, device=device)
    a = dict(xBC=torch.randn(Bsz, K, C, device=device), dt=torch.randn(Bsz, K, H, device=device),
             conv_state=torch.randn(S, C, W - 1, device=device), ssm_state=torch.randn(S, H, P, N, device=device),
             slot_ids=slot_ids(Bsz, device), **prm,
             ssm_stash=torch.empty(Bsz, K, H, P, N, device=device), conv_stash=torch.empty(Bsz, C, W - 1 + K, device=device),
             n_groups=G)
    a.update(over)
    return a


BAD_VERIFY = {
    "dt-shape": lambda d: dict(dt=torch.randn(2, 2, 3, device=d)),
    "conv_stash-width": lambda d: dict(conv_stash=torch.empty(2, 64, 4, device=d)),
    "ssm_state-fp16": lambda d: dict(ssm_state=torch.randn(S, 2, 12, 10, device=d).half()),
    "ssm_stash-noncontig": lambda d: dict(ssm_stash=torch.empty(2, 2, 2, 10, 12, device=d).transpose(-1, -2)),
    "groups-mismatch": lambda d: dict(n_groups=2),
    "slot_ids-float": lambda d: dict(slot_ids=torch.tensor([3.0, 0.0], device=d)),
}


@pytest.mark.parametrize("bad", list(BAD_VERIFY), ids=list(BAD_VERIFY))
def test_mamba_verify_rejects_bad_inputs(bad, device):
    with pytest.raises(ValueError, match="mamba_verify"):
        mamba_verify(**_verify_inputs(device, **BAD_VERIFY[bad](device)))


def test_other_launchers_reject_bad_inputs(device):
    L, Bsz, K, H, P, N, C, W = 1, 2, 3, 2, 4, 8, 40, 4
    ss, cs = torch.zeros(L, S, H, P, N, device=device), torch.zeros(L, S, C, W - 1, device=device)
    sst, cst = torch.zeros(L, Bsz, K, H, P, N, device=device), torch.zeros(L, Bsz, C, W - 1 + K, device=device)
    slots, na = slot_ids(Bsz, device), torch.zeros(Bsz, dtype=torch.long, device=device)
    act = torch.ones(Bsz, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="commit_state"):
        commit_state(ss, cs, sst, cst[..., :-1], slots, na, act)  # conv_stash too narrow
    with pytest.raises(ValueError, match="commit_state"):
        commit_state(ss, cs, sst, cst, slots, na, act.long())  # active not bool
    with pytest.raises(ValueError, match="commit_state"):
        commit_state(ss, cs, sst, cst, slots[:1], na, act)
    prm = make_layer(2, 12, 10, 1, 4, device=device)
    x, dt = torch.randn(5, 64, device=device), torch.randn(5, 2, device=device)
    scan_args = (prm["conv_weight"], prm["conv_bias"], prm["dt_bias"], prm["A_log"], prm["D"], 1, 12)
    with pytest.raises(ValueError, match="mamba_scan"):
        mamba_scan(x[:, :60], dt, *scan_args)  # C does not match conv_weight
    with pytest.raises(ValueError, match="mamba_scan"):
        mamba_scan(x, dt, *scan_args, method="fast")
    with pytest.raises(ValueError, match="mamba_scan"):
        mamba_scan(x.t().contiguous().t(), dt, *scan_args)  # column-major xBC
    with pytest.raises(ValueError, match="rmsnorm"):
        rmsnorm(torch.randn(3, 8, device=device), torch.randn(7, device=device), 1e-5)
    with pytest.raises(ValueError, match="rmsnorm"):
        rmsnorm(torch.randn(8, 3, device=device).t(), torch.randn(8, device=device), 1e-5)
    with pytest.raises(ValueError, match="gated_rmsnorm"):
        gated_rmsnorm(torch.randn(2, 12, device=device), torch.randn(2, 12, device=device),
                      torch.randn(12, device=device), 5, 1e-5)


LAUNCHERS = {  # launcher, valid keyword arguments on a device
    "mamba_verify": (mamba_verify, _verify_inputs),
    "commit_state": (commit_state, lambda d: dict(
        ssm_state=torch.zeros(2, S, 2, 4, 8, device=d), conv_state=torch.zeros(2, S, 40, 3, device=d),
        ssm_stash=torch.zeros(2, 2, 3, 2, 4, 8, device=d), conv_stash=torch.zeros(2, 2, 40, 6, device=d),
        slot_ids=slot_ids(2, d), na=torch.zeros(2, dtype=torch.long, device=d),
        active=torch.ones(2, dtype=torch.bool, device=d))),
    "mamba_scan": (mamba_scan, lambda d: dict(xBC=torch.randn(5, 44, device=d), dt=torch.randn(5, 2, device=d),
                                             **make_layer(2, 12, 10, 1, 4, device=d), n_groups=1, head_dim=12)),
    "rmsnorm": (rmsnorm, lambda d: dict(x=torch.randn(3, 8, device=d), weight=torch.randn(8, device=d), eps=1e-5,
                                        residual=torch.randn(3, 8, device=d))),
    "gated_rmsnorm": (gated_rmsnorm, lambda d: dict(y=torch.randn(2, 12, device=d), z=torch.randn(2, 12, device=d),
                                                    weight=torch.randn(12, device=d), group_size=6, eps=1e-5)),
}
REFUSALS = [  # launcher, argument, fault
    ("mamba_verify", "dt", "shape"), ("mamba_verify", "ssm_stash", "dtype"), ("mamba_verify", "conv_state", "noncontig"),
    ("mamba_verify", "xBC", "stride"), ("mamba_verify", "slot_ids", "device"),
    ("commit_state", "conv_stash", "shape"), ("commit_state", "active", "dtype"),
    ("commit_state", "ssm_stash", "noncontig"), ("commit_state", "na", "device"),
    ("mamba_scan", "dt", "shape"), ("mamba_scan", "xBC", "dtype"), ("mamba_scan", "D", "noncontig"),
    ("mamba_scan", "dt", "stride"), ("mamba_scan", "conv_weight", "device"),
    ("rmsnorm", "weight", "shape"), ("rmsnorm", "residual", "dtype"), ("rmsnorm", "weight", "noncontig"),
    ("rmsnorm", "residual", "stride"), ("rmsnorm", "weight", "device"),
    ("gated_rmsnorm", "z", "shape"), ("gated_rmsnorm", "y", "dtype"), ("gated_rmsnorm", "weight", "noncontig"),
    ("gated_rmsnorm", "z", "stride"), ("gated_rmsnorm", "weight", "device"),
]


@pytest.mark.parametrize("kernel, arg, fault", REFUSALS, ids=["-".join(c) for c in REFUSALS])
def test_launchers_name_the_bad_argument(kernel, arg, fault, device):
    """One argument wrong in one way: a ValueError naming the kernel, the argument and what is wrong."""
    launcher, inputs = LAUNCHERS[kernel]
    assert_refuses(kernel, launcher, inputs(device), arg, fault)
