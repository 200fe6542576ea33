"""The compiled CPU step's ops (nano_spec/model/cpu_rows.py, kernels in C++), called outside a graph.

The Mamba verify (graph_ops.mamba_verify, its recurrence in C++) against the torch reference mamba_verify_ref: the
stash's rows a commit reads and the states bit for bit (the last row goes to the live state only), y to 1e-4, the
slots it must not touch unchanged; the prompt scan (graph_ops.mamba_scan) against mamba_scan_ref; the kernel alone
computes every row as a one-row call does. The cache writes (kv_write) and the commit (commit_state) against torch's
indexing and commit_state_ref. The attention of a verify's rows (graph_ops.attention_verify: kv_write, then attend)
against attention_verify_ref, attend alone against float64 over the rows each query sees, a row the same in any call.
The products of few rows by a packed weight (rows_mm) against float64, a row the same in any call, the linears of a
network packed (pack_linears) against ATen's, and the block the packed copies share (on_huge_pages)."""
import gc
import mmap

import pytest
import torch

import torch.nn.functional as F

from helpers import assert_close, assert_unchanged, int8_rounded, tiny_model
from nano_spec.model.cpu_rows import (DRAFT_ROWS_MAX, HUGE_PAGE, ROWS_MAX, RowsLinear, attend, attend_block,
                                      commit_state, conv_rows, int8_rows, kv_write, linear, mamba_scan_rows,
                                      mamba_write, on_huge_pages, pack_linears, pack_rows, rows_linear, rows_mm,
                                      rows_weight)
from nano_spec.model.graph_ops import attention_block, attention_prefill, attention_verify, mamba_scan, mamba_verify
from nano_spec_kernels.attention_prefill import attention_prefill_ref
from nano_spec_kernels.attention_verify import _attend_ref, attention_block_ref, attention_verify_ref
from nano_spec_kernels.mamba_scan import mamba_scan_ref
from nano_spec_kernels.mamba_verify import mamba_verify_ref
from nano_spec_kernels.commit_state import commit_state_ref
from test_kernels_mamba import COMMIT_CASES, INF, S, SLOTS, VERIFY_CASES, make_layer, run_verify, slot_ids

NAMES = ("y", "conv_state", "ssm_state", "ssm_stash", "conv_stash")
CASES = VERIFY_CASES + [("N37-two-vector-blocks-and-a-tail", (2, 4, 4, 12, 37, 2, 4), True, (0.0, INF))]


def inputs(Bsz, K, H, P, N, G, W, bias=True):
    C = H * P + 2 * G * N
    return (make_layer(H, P, N, G, W, bias), torch.randn(Bsz, K, C), torch.randn(Bsz, K, H),
            torch.randn(S, C, W - 1), torch.randn(S, H, P, N))


@pytest.mark.parametrize("shape,bias,dt_limit", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_ref(shape, bias, dt_limit):
    Bsz, K, H, P, N, G, W = shape
    prm, xBC, dt, conv_state, ssm_state = inputs(*shape, bias)
    ref = run_verify(mamba_verify_ref, xBC, dt, conv_state, ssm_state, slot_ids(Bsz), prm, G, dt_limit)
    out = run_verify(mamba_verify, xBC, dt, conv_state, ssm_state, slot_ids(Bsz), prm, G, dt_limit)
    assert_close("y", ref[0], out[0])
    for name, r, o in list(zip(NAMES, ref, out))[1:]:  # the state's arithmetic is the reference's
        if name == "ssm_stash":  # the last row's state goes to the live state only: no commit reads it
            r, o = r[:, :K - 1], o[:, :K - 1]
            assert out[3][:, K - 1].isnan().all(), "ssm_stash's last row written"
        assert_unchanged(name, r, o)
    untouched = [s for s in range(S) if s not in SLOTS[:Bsz]]
    assert_unchanged("conv_state of other slots", conv_state[untouched], out[1][untouched])
    assert_unchanged("ssm_state of other slots", ssm_state[untouched], out[2][untouched])


def mamba_rows(ssm_state, ssm_stash, slots, decay, u, Bm, Cm):
    """mamba_write's recurrence, beside a conv of one channel: y."""
    Bsz, K = u.shape[:2]
    return mamba_write(torch.zeros(ssm_state.shape[0], 1, 1), ssm_state, torch.empty(Bsz, 1, 1 + K), ssm_stash,
                       slots, torch.zeros(Bsz, 1, 1 + K), decay, u, Bm, Cm)


def rows_inputs(Bsz, K, H, P, N, G):
    """mamba_rows' inputs in their ranges: decay in (0, 1), u = dt x, B and C."""
    return torch.rand(Bsz, K, H) * 0.98 + 0.01, torch.randn(Bsz, K, H, P), torch.randn(Bsz, K, G, N), \
        torch.randn(Bsz, K, G, N)


# (B, K, H, P, N, G); the last: 3 MB of stash rows (3 x 4 rows of 256 KB), which mamba_write streams past the caches
ROWS_CASES = [("K2", (3, 2, 4, 12, 37, 2)), ("K4", (3, 4, 4, 12, 37, 2)), ("K5", (3, 5, 4, 12, 37, 2)),
              ("K5-stash-streamed", (3, 5, 16, 64, 64, 1))]


@pytest.mark.parametrize("Bsz,K,H,P,N,G", [c[1] for c in ROWS_CASES], ids=[c[0] for c in ROWS_CASES])
def test_k_rows_equal_k_one_row_calls(Bsz, K, H, P, N, G):
    """Row j of a K-row call is what a 1-row call from the state after row j-1 gives, y included, bit for bit:
    y's sum over N runs in the same order whatever K (the kernel's part of spec = plain; the graph's own
    elementwise ops around it are inductor's)."""
    decay, u, Bm, Cm = rows_inputs(Bsz, K, H, P, N, G)
    state = torch.randn(S, H, P, N)
    slots, stash, one_state = slot_ids(Bsz), torch.empty(Bsz, K, H, P, N), state.clone()
    y = mamba_rows(state, stash, slots, decay, u, Bm, Cm)
    for j in range(K):
        row = slice(j, j + 1)
        y1 = mamba_rows(one_state, torch.empty(Bsz, 1, H, P, N), slots, decay[:, row], u[:, row], Bm[:, row],
                        Cm[:, row])
        assert_unchanged(f"y row {j}", y[:, row], y1)
        if j < K - 1:  # the stash holds the states a commit may rewind to: rows 0..K-2
            assert_unchanged(f"ssm_stash row {j}", stash[:, j], one_state[slots])
    assert_unchanged("ssm_state", state, one_state)


def bc_layouts(xBC, H, P, G, N):
    """B and C (Bsz, K, G, N) laid out as a step may hand them, each with the same values: views of xBC's rows,
    contiguous copies, and layouts mamba_write must copy first or read with the right row stride."""
    Bv = xBC[..., H * P:H * P + G * N].unflatten(-1, (G, N))
    Cv = xBC[..., H * P + G * N:].unflatten(-1, (G, N))
    wider = torch.cat([xBC, torch.randn(xBC.shape[0], 1, xBC.shape[-1])], dim=1)[:, :-1]  # sequences K+1 rows apart
    spread = torch.stack([xBC, torch.randn_like(xBC)], dim=2).flatten(1, 2)[:, ::2]  # rows 2 C apart, evenly
    n_apart = torch.stack([Bv, torch.randn_like(Bv)], dim=-1)[..., 0]  # N values 2 apart
    one = xBC[:1, :1].clone().expand_as(xBC)  # every row the same values, stride 0
    return {"views": (Bv, Cv), "contiguous": (Bv.contiguous(), Cv.contiguous()),
            "C-transposed": (Bv, Cv.transpose(0, 1).contiguous().transpose(0, 1)),
            "sequences-apart": (wider[..., H * P:H * P + G * N].unflatten(-1, (G, N)),
                                wider[..., H * P + G * N:].unflatten(-1, (G, N))),
            "rows-apart": (spread[..., H * P:H * P + G * N].unflatten(-1, (G, N)),
                           spread[..., H * P + G * N:].unflatten(-1, (G, N))),
            "N-apart": (n_apart, Cv),
            "expanded": (one[..., H * P:H * P + G * N].unflatten(-1, (G, N)),
                         one[..., H * P + G * N:].unflatten(-1, (G, N)))}


@pytest.mark.parametrize("Bsz,K,G", [(3, 4, 2), (1, 1, 1), (2, 5, 1), (1, 3, 1)],
                         ids=["B3-K4-G2", "B1-K1", "B2-K5", "B1-K3"])
def test_b_and_c_are_read_in_any_layout(Bsz, K, G):
    """B and C as the graph hands them (views of a step's xBC rows [x | B | C], read where they lie) or in any other
    layout (read with their row stride, or copied first) give what contiguous copies give, bit for bit, in
    mamba_write and in a prompt's mamba_scan_rows. A layout read with a wrong row stride would read other values."""
    H, P, N = 4, 12, 20
    decay, u = torch.rand(Bsz, K, H) * 0.98 + 0.01, torch.randn(Bsz, K, H, P)
    xBC = torch.randn(Bsz, K, H * P + 2 * G * N)
    state, slots = torch.randn(S, H, P, N), slot_ids(Bsz)
    outs = {}
    for name, (Bm, Cm) in bc_layouts(xBC, H, P, G, N).items():
        Bc, Cc = Bm.contiguous(), Cm.contiguous()
        for inputs, (b, c) in (("as laid out", (Bm, Cm)), ("contiguous", (Bc, Cc))):
            st, stash = state.clone(), torch.empty(Bsz, K, H, P, N)
            scan_state = state[0].clone()
            outs[name, inputs] = (mamba_rows(st, stash, slots, decay, u, b, c), st, stash[:, :K - 1],
                                  mamba_scan_rows(scan_state, decay[0], u[0], b[0], c[0]), scan_state)
        for what, a, b in zip(("y", "ssm_state", "stash", "scan y", "scan state"), outs[name, "contiguous"],
                              outs[name, "as laid out"]):
            assert_unchanged(f"{name}: {what}", a, b)


def test_padded_batch_repeating_a_slot_reads_the_state_before_the_step():
    """A padded batch repeats row 0 (same slot, same inputs): the repeat computes from the state before the step,
    not from row 0's result, and the slot advances once."""
    Bsz, K, H, P, N, G, W = 3, 3, 4, 12, 20, 2, 4
    prm, xBC, dt, conv_state, ssm_state = inputs(*(Bsz, K, H, P, N, G, W))
    xBC[2], dt[2] = xBC[0], dt[0]
    slots = torch.tensor([SLOTS[0], SLOTS[1], SLOTS[0]])
    ref = run_verify(mamba_verify_ref, xBC, dt, conv_state, ssm_state, slots, prm, G)
    out = run_verify(mamba_verify, xBC, dt, conv_state, ssm_state, slots, prm, G)
    assert_close("y", ref[0], out[0])
    assert_unchanged("y of the repeat", out[0][0], out[0][2])
    for name, r, o in list(zip(NAMES, ref, out))[1:]:
        assert_unchanged(name, r, o)


def test_a_slot_out_of_range_is_refused_before_any_write():
    Bsz, K, H, P, N, G = 2, 2, 4, 12, 20, 2
    state = torch.randn(S, H, P, N)
    before, stash = state.clone(), torch.zeros(Bsz, K, H, P, N)
    with pytest.raises(ValueError, match=r"mamba_write: slot 7 \(row 1\) must lie in \[0, 7\)"):
        mamba_rows(state, stash, torch.tensor([0, S]), *rows_inputs(Bsz, K, H, P, N, G))
    assert_unchanged("ssm_state", before, state)
    assert not stash.any()
    with pytest.raises(ValueError, match=r"mamba_write: slot_ids \(B,\), decay \(B, K, H\)"):  # one id short
        mamba_rows(state, stash, torch.tensor([0]), *rows_inputs(Bsz, K, H, P, N, G))
    assert_unchanged("ssm_state after the short ids", before, state)


def test_a_state_of_another_layout_is_refused():
    Bsz, K, H, P, N, G = 1, 2, 4, 12, 20, 2
    with pytest.raises(ValueError, match="mamba_write: ssm_state must be fp32"):
        mamba_rows(torch.randn(S, H, N, P).transpose(2, 3), torch.zeros(Bsz, K, H, P, N), slot_ids(Bsz),
                   *rows_inputs(Bsz, K, H, P, N, G))


SCAN_CASES = [("T1", (1, 4, 12, 20, 2, 4), True), ("T2-short-of-the-window", (2, 4, 12, 20, 1, 4), False),
              ("T37-N37-tail", (37, 4, 12, 37, 2, 4), True), ("T70-W2", (70, 2, 16, 32, 1, 2), True)]


@pytest.mark.parametrize("shape,bias", [c[1:] for c in SCAN_CASES], ids=[c[0] for c in SCAN_CASES])
def test_prompt_scan_matches_the_recurrent_reference(shape, bias):
    """A compiled engine's prefill scan (graph_ops.mamba_scan: mamba_scan_rows in place over a zero state) against
    the token loop of mamba_scan_ref: the state bit for bit (the reference's arithmetic), the window exactly, y to
    1e-4 (its own order of sums over N)."""
    T, H, P, N, G, W = shape
    prm = make_layer(H, P, N, G, W, bias)
    xBC, dt = torch.randn(T, H * P + 2 * G * N), torch.randn(T, H)
    ref = mamba_scan_ref(xBC, dt, **prm, n_groups=G, head_dim=P)
    out = mamba_scan(xBC, dt, **prm, n_groups=G, head_dim=P)
    assert_close("y", ref[0], out[0])
    assert_unchanged("ssm_state", ref[1], out[1])
    assert_unchanged("conv window", ref[2], out[2])


@pytest.mark.parametrize("T,dtype,cols", [(2, torch.float32, 21), (37, torch.float32, 21), (37, torch.bfloat16, 21),
                                          (37, torch.float32, 30)],
                         ids=["T2-short-of-the-window", "T37", "T37-bf16", "T37-columns-of-wider-rows"])
def test_prompt_conv_equals_shifted_sums(T, dtype, cols):
    """conv_rows, a prompt's causal conv from a zero window, against W shifted multiply-adds in torch, bit for bit
    (x also as the first C columns of wider rows, as a prompt's xBC is of its in_proj's; the weight (C, W) as it is,
    and as a view whose taps' C values lie together, in rows C and C + 3 apart, as a compiled prompt hands it);
    a bias of the wrong size is refused."""
    C, W = 21, 4
    x, w, bias = torch.randn(T, cols).to(dtype)[:, :C], torch.randn(C, W), torch.randn(C)
    xpad = F.pad(x.float(), (0, 0, W - 1, 0))  # (W-1+T, C)
    ref = sum(xpad[k:k + T] * w[:, k] for k in range(W)) + bias
    wide = torch.zeros(W, C + 3)
    wide[:, :C] = w.t()
    for name, taps in (("(C, W)", w), ("(W, C) rows", w.t().contiguous().t()), ("(W, C + 3) rows", wide[:, :C].t())):
        assert_unchanged(f"conv, weight {name}", ref, conv_rows(x, taps, bias))
    with pytest.raises(ValueError, match=r"conv_rows: x must be \(T, C\), weight \(C, W\) and bias \(C,\)"):
        conv_rows(x, w, bias[:-1])


def test_prompt_scan_threads_share_the_heads_and_change_no_sum():
    """The heads shared out over two threads give the one-thread y and state bit for bit."""
    T, H, P, N, G = 9, 6, 8, 20, 3
    decay, u, Bm, Cm = (t[0] for t in rows_inputs(1, T, H, P, N, G))
    start = torch.randn(H, P, N)
    one = start.clone()
    y_one = mamba_scan_rows(one, decay, u, Bm, Cm)
    before, two = torch.get_num_threads(), start.clone()
    torch.set_num_threads(2)
    try:
        y_two = mamba_scan_rows(two, decay, u, Bm, Cm)
    finally:
        torch.set_num_threads(before)
    assert_unchanged("y, two threads against one", y_one, y_two)
    assert_unchanged("state, two threads against one", one, two)


def test_prompt_scan_refuses_what_does_not_fit():
    T, H, P, N, G = 3, 4, 12, 20, 2
    decay, u, Bm, Cm = (t[0] for t in rows_inputs(1, T, H, P, N, G))
    with pytest.raises(ValueError, match="mamba_scan_rows: state must be a contiguous fp32"):
        mamba_scan_rows(torch.zeros(H, N, P).transpose(1, 2), decay, u, Bm, Cm)
    with pytest.raises(ValueError, match="mamba_scan_rows: state must be a contiguous fp32"):
        mamba_scan_rows(torch.zeros(H, P, N), decay, u, Bm[:, :1].expand(T, 3, N), Cm[:, :1].expand(T, 3, N))
    with pytest.raises(ValueError, match=r"mamba_scan_rows: state must be \(H, P, N\)"):
        mamba_scan_rows(torch.zeros(H, P, N), decay, u[None], Bm, Cm)


def test_the_library_is_built_whole_into_its_cache(tmp_path, monkeypatch):
    """A build leaves one library in the cache directory and nothing half-written; a compiler that fails is a
    RuntimeError with its message, not a library that is missing later."""
    from nano_spec.model.cpu_rows import build

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    path = build()
    assert list((tmp_path / "nano_spec").iterdir()) == [path] and path.name.startswith("cpu_rows_")
    assert path.suffix == ".so" and build() == path  # built once
    monkeypatch.setenv("CXX", "false")  # exits 1: another compiler, another key, so it must build
    with pytest.raises(RuntimeError, match="compile: false could not build the CPU step's kernels"):
        build()
    assert list((tmp_path / "nano_spec").iterdir()) == [path]


def test_a_compiler_without_openmp_builds_the_library_serial(tmp_path, monkeypatch):
    """A compiler that refuses -fopenmp still builds the library, once, without it (rows_mm then runs its blocks
    on one thread)."""
    import shutil

    from nano_spec.model.cpu_rows import OPENMP, build

    calls = tmp_path / "calls"
    cxx = tmp_path / "cxx-without-openmp"
    cxx.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase " $* " in *" {OPENMP} "*) exit 1;; esac\n'
                   f'exec {shutil.which("c++") or shutil.which("g++")} "$@"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(cxx))
    path = build()
    tried = calls.read_text().splitlines()
    assert len(tried) == 2 and OPENMP in tried[0].split() and OPENMP not in tried[1].split()
    assert path.exists() and build() == path and len(calls.read_text().splitlines()) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_write_equals_indexing(dtype):
    """The K rows land where torch's indexed write puts them, bit for bit, and nothing else moves, in caches cut to
    a step's KV rows as a graph's are; a position past them is refused before any write."""
    Bsz, K, L, Hkv, Dh = 3, 4, 11, 2, 6
    caches = torch.randn(2, S, L + 5, Hkv, Dh, dtype=dtype)  # k and v, 5 rows past the graph's KV rows
    k, v = torch.randn(Bsz, K, Hkv, Dh, dtype=dtype), torch.randn(Bsz, K, Hkv, Dh, dtype=dtype)
    slots, pos = slot_ids(Bsz), torch.stack([torch.randperm(L)[:K] for _ in range(Bsz)])  # (B, K)
    ref, out = caches.clone(), caches.clone()
    ref[0][slots[:, None], pos], ref[1][slots[:, None], pos] = k, v
    kv_write(out[0, :, :L], out[1, :, :L], slots, pos, k, v)
    assert_unchanged("k_cache", ref[0], out[0])
    assert_unchanged("v_cache", ref[1], out[1])
    pos[2, 1], kept = L, caches.clone()
    with pytest.raises(ValueError, match=rf"kv_write: position {L} \(row 2, 1\) must lie in \[0, {L}\)"):
        kv_write(kept[0, :, :L], kept[1, :, :L], slots, pos, k, v)
    assert_unchanged("caches after a refusal", caches, kept)


# (B, K, Hq, Hkv, Dh, L): head dims of no vector, one and a rest, three vectors (the vector count read at run time),
# four (the shipped model's) and eight (compiled unrolled) over several blocks of 16 rows and a part of one; a cache
# longer than any row sees
ATTEND_CASES = [("Dh12-rep2", (3, 4, 4, 2, 12, 23)), ("Dh37-one-query-head", (2, 3, 1, 1, 37, 40)),
                ("Dh48-rep3-one-row", (3, 1, 6, 2, 48, 70)), ("Dh64-rep2-blocks", (2, 4, 4, 2, 64, 75)),
                ("Dh128-rep2-blocks", (2, 3, 2, 1, 128, 40))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [c[1] for c in ATTEND_CASES], ids=[c[0] for c in ATTEND_CASES])
def test_attend_matches_float64(shape, dtype):
    """Each query row over its slot's rows 0..pos and no others (rows past them hold huge values that would show),
    against float64 over the same cache; a row comes out the same, bit for bit, in a 1-row call."""
    Bsz, K, Hq, Hkv, Dh, L = shape
    caches = torch.randn(2, S, L, Hkv, Dh).to(dtype)
    q, slots = torch.randn(Bsz, K, Hq, Dh), slot_ids(Bsz)
    pos = torch.randint(0, L - K, (Bsz, 1)) + torch.arange(K)  # (B, K)
    for b in range(Bsz):
        caches[:, slots[b], pos[b, -1] + 1:] = 1e4
    out = attend(q, caches[0], caches[1], slots, pos, 0.3)
    visible = torch.arange(L)[None, None, :] <= pos[:, :, None]  # (B, K, L)
    ref = _attend_ref(q.double(), caches[0][slots].double(), caches[1][slots].double(), visible[:, None], 0.3)
    assert_close("o", ref, out, atol=1e-5)
    for j in range(K):
        assert_unchanged(f"row {j} alone", out[:, j:j + 1], attend(q[:, j:j + 1], caches[0], caches[1], slots,
                                                                   pos[:, j:j + 1], 0.3))


def test_views_of_a_fused_qkv_are_read_in_place():
    """q, k and v as a step has them, views of one fused (B, K, Hq + 2 Hkv, Dh) product: kv_write and attend give
    what they give for contiguous copies, bit for bit."""
    Bsz, K, Hq, Hkv, Dh, L = 3, 2, 4, 2, 20, 30
    qkv = torch.randn(Bsz, K, Hq + 2 * Hkv, Dh)
    q, k, v = qkv.split([Hq, Hkv, Hkv], dim=2)
    slots, pos = slot_ids(Bsz), torch.tensor([[3, 4], [17, 18], [27, 28]])
    caches = torch.randn(2, S, L, Hkv, Dh)
    views, copies = caches.clone(), caches.clone()
    kv_write(views[0], views[1], slots, pos, k, v)
    kv_write(copies[0], copies[1], slots, pos, k.contiguous(), v.contiguous())
    assert_unchanged("caches", copies, views)
    assert_unchanged("o", attend(q.contiguous(), *copies, slots, pos, 0.3), attend(q, *views, slots, pos, 0.3))


def test_attend_threads_share_the_rows_and_change_no_sum():
    """attend over two threads (24 query rows and heads shared out) gives the one-thread output bit for bit, a
    block's own rows too."""
    caches, q, slots = torch.randn(2, S, 50, 2, 20), torch.randn(3, 2, 4, 20), slot_ids(3)
    pos, own = torch.tensor([[4, 5], [30, 31], [48, 49]]), torch.randn(2, 3, 2, 2, 20)
    one = attend(q, caches[0], caches[1], slots, pos, 0.3), attend_block(q, *caches, slots, pos, 0.3, *own)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = attend(q, caches[0], caches[1], slots, pos, 0.3), attend_block(q, *caches, slots, pos, 0.3, *own)
    finally:
        torch.set_num_threads(before)
    assert_unchanged("two threads against one", one[0], two[0])
    assert_unchanged("two threads against one, with own rows", one[1], two[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,rope", [(1, None), (37, 10000.0)], ids=["T1-nope", "T37-rope"])
def test_prompt_attention_equals_the_reference(T, rope, dtype):
    """A compiled engine's prompt attention (graph_ops.attention_prefill, SDPA) against attention_prefill_ref: the
    cache rows bit for bit, the other slots and rows untouched, the output to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, 12, generator=g).to(dtype) for h in (4, 2, 2))  # GQA: 2 query heads a KV head
    caches = [torch.randn(3, T + 5, 2, 12, generator=g).to(dtype).expand(2, -1, -1, -1, -1).clone()
              for _ in range(2)]  # k, v: (ref|out, S, L, Hkv, Dh), the two copies alike
    before = [c.clone() for c in caches]
    ref = attention_prefill_ref(q, k, v, caches[0][0], caches[1][0], 1, 0.3, rope)
    out = attention_prefill(q, k, v, caches[0][1], caches[1][1], 1, 0.3, rope)
    assert_close("o", ref, out, atol=1e-4 if dtype == torch.float32 else 1e-2)  # bf16: one rounding of o
    for name, c, b in zip(("k_cache", "v_cache"), caches, before):
        assert_unchanged(name, c[0], c[1])
        assert_unchanged(f"{name}: other slots and rows", b[1][[0, 2]], c[1][[0, 2]])
        assert_unchanged(f"{name}: rows past the prompt", b[1][1, T:], c[1][1, T:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_attention_equals_the_reference(dtype):
    """graph_ops.attention_verify, as a compiled step runs it (caches cut to a step's KV rows): the reference's
    cache writes bit for bit and its output to rounding; a position past the rows, and a q of 3 dims, are refused."""
    Bsz, K, Hq, Hkv, Dh, L = 3, 4, 4, 2, 12, 17
    caches = torch.randn(2, S, L + 5, Hkv, Dh, dtype=dtype)
    q, k, v = torch.randn(Bsz, K, Hq, Dh, dtype=dtype), *torch.randn(2, Bsz, K, Hkv, Dh, dtype=dtype)
    slots, seq_lens = slot_ids(Bsz), torch.tensor([0, 9, L - K])
    ref, out = caches.clone(), caches.clone()
    o_ref = attention_verify_ref(q, k, v, ref[0, :, :L], ref[1, :, :L], slots, seq_lens, 0.3, 10_000.0)
    o = attention_verify(q, k, v, out[0, :, :L], out[1, :, :L], slots, seq_lens, 0.3, 10_000.0)
    assert_unchanged("caches", ref, out)
    assert_close("o", o_ref, o, atol=1e-5 if dtype == torch.float32 else 1e-2)
    pos = seq_lens[:, None] + torch.arange(K)
    pos[2, 1] = L
    with pytest.raises(ValueError, match=rf"attend: position {L} \(row 2, 1\) must lie in \[0, {L}\)"):
        attend(q.float(), out[0, :, :L], out[1, :, :L], slots, pos, 0.3)
    with pytest.raises(ValueError, match=r"attend: q \(B, K, Hq, Dh\), caches .* are 4-d"):
        attend(q.float()[0], out[0, :, :L], out[1, :, :L], slots, pos, 0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Dh,L,Kb", [(12, 17, 4), (64, 37, 9)], ids=["Dh12", "Dh64-rows-across-blocks"])
def test_graph_block_attention_equals_the_reference(Dh, L, Kb, dtype):
    """graph_ops.attention_block: a block drafter's rows over their slot's context rows (one with none) and their
    own block, against attention_block_ref; the caches are only read."""
    Bsz, Hq, Hkv = 3, 4, 2
    caches = torch.randn(2, S, L, Hkv, Dh, dtype=dtype)
    q, k, v = torch.randn(Bsz, Kb, Hq, Dh, dtype=dtype), *torch.randn(2, Bsz, Kb, Hkv, Dh, dtype=dtype)
    slots, ctx_lens, kept = slot_ids(Bsz), torch.tensor([0, 9, L]), caches.clone()
    ref = attention_block_ref(q, k, v, caches[0], caches[1], slots, ctx_lens, 0.3, 10_000.0)
    out = attention_block(q, k, v, caches[0], caches[1], slots, ctx_lens, 0.3, 10_000.0)
    assert_close("o", ref, out, atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert_unchanged("caches", kept, caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-conv"])
@pytest.mark.parametrize("K,na,active", [c[1:] for c in COMMIT_CASES], ids=[c[0] for c in COMMIT_CASES])
def test_commit_state_equals_the_reference(K, na, active, dtype):
    """commit_state_ref's states, bit for bit: the rows that move copied, every other slot untouched."""
    L, Bsz, H, P, N, C, W = 2, 3, 3, 12, 10, 50, 4
    ssm_state, conv_state = torch.randn(L, S, H, P, N), torch.randn(L, S, C, W - 1).to(dtype)
    stashes = torch.randn(L, Bsz, K, H, P, N), torch.randn(L, Bsz, C, W - 1 + K).to(dtype)
    rows = (slot_ids(Bsz), torch.tensor(na), torch.tensor(active))
    ref, out = (ssm_state.clone(), conv_state.clone()), (ssm_state.clone(), conv_state.clone())
    commit_state_ref(*ref, *stashes, *rows)
    commit_state(*out, *stashes, *rows)
    assert_unchanged("ssm_state", ref[0], out[0])
    assert_unchanged("conv_state", ref[1], out[1])


def test_an_op_without_a_kernel_is_an_error_not_a_loop():
    """An op's Python kernel loads the library and calls the op again, which the library's CPU kernel takes: an op
    the library has no kernel for must say so rather than call itself until the stack runs out."""
    from nano_spec.model.cpu_rows import cpu_op

    op = cpu_op("kernel_less_for_a_test(Tensor x) -> Tensor", meta=lambda x: torch.empty_like(x))
    with pytest.raises(RuntimeError, match="nano_spec::kernel_less_for_a_test: cpu_rows.cpp registers no CPU kernel"):
        op(torch.zeros(2))


ROWS_CASES = [  # (M, N, K): rows, output columns, inputs
    ("one-row-one-short-block", (1, 5, 7)),
    ("in_proj-width-with-a-tail", (4, 1160, 256)),
    ("rows-past-a-pass-and-blocks", (13, 65, 33)),
    ("rows-max-and-vocab", (ROWS_MAX, 4096, 64)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("shape", [c[1] for c in ROWS_CASES], ids=[c[0] for c in ROWS_CASES])
def test_rows_mm_matches_float64(shape, dtype):
    """Against float64 over the weight as packed: an int8 copy is the weight rounded to int8 levels, its sums fp32."""
    M, N, K = shape
    w, x = torch.randn(N, K), torch.randn(M, K)
    w[N // 2] = 0  # a zero row: scale 0
    out = rows_mm(x, pack_rows(w.t().contiguous().t(), dtype), N)  # the engine's input-major layout packs alike
    held = int8_rounded(w) if dtype == torch.int8 else w
    assert_close("y", x.double() @ held.double().t(), out, atol=1e-5)


def test_int8_levels_keep_each_rows_range():
    """Each row's max |w| lands on ±127 and every value within half a level of its own; the copy holds exactly
    those values (rows_weight), whatever the rows' ranges (1e-30 .. 1e30) and of any layout."""
    w = torch.randn(70, 40) * torch.logspace(-30, 30, 70)[:, None]
    w[3], w[5, 7] = 0, -w[5].abs().max() * 2
    q, scale = int8_rows(w.t().contiguous().t())
    assert q.dtype == torch.int8 and q.abs().amax(dim=1)[w.abs().amax(dim=1) > 0].eq(127).all() and q[3].eq(0).all()
    assert q[5, 7] == -127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert_unchanged("the copy's weight", q.float() * scale[:, None], rows_weight(pack_rows(w, torch.int8), 70))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("M", [2, 4, 5, ROWS_MAX], ids=lambda m: f"M{m}")
def test_a_row_comes_out_the_same_in_any_call(M, dtype):
    """Row m of an M-row call is its 1-row call's, bit for bit (spec = plain within the compiled mode)."""
    w, x = torch.randn(70, 40), torch.randn(M, 40)
    packed = pack_rows(w, dtype)
    one_by_one = torch.cat([rows_mm(x[m:m + 1], packed, 70) for m in range(M)])
    assert_unchanged("rows of one call against 1-row calls", one_by_one, rows_mm(x, packed, 70))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
def test_threads_share_the_blocks_and_change_no_sum(dtype):
    """rows_mm over two threads (19 blocks of columns shared out) gives the one-thread product bit for bit."""
    w, x = torch.randn(600, 40), torch.randn(3, 40)
    packed = pack_rows(w, dtype)
    one = rows_mm(x, packed, 600)
    torch.set_num_threads(2)
    try:
        assert_unchanged("two threads against one", one, rows_mm(x, packed, 600))
    finally:
        torch.set_num_threads(1)


def test_rows_mm_refuses_what_does_not_fit():
    packed = pack_rows(torch.randn(8, 6))
    for x, n in ((torch.randn(2, 5), 8), (torch.randn(2, 6).bfloat16(), 8), (torch.randn(2, 6), 8 + 32)):
        with pytest.raises(ValueError, match="rows_mm: x"):
            rows_mm(x, packed, n)
    with pytest.raises(ValueError, match="rows_mm: x"):
        rows_mm(torch.randn(2, 6), packed.half(), 8)
    with pytest.raises(ValueError, match="rows_mm: x"):  # an int8 copy's scales are 4 more rows than its K
        rows_mm(torch.randn(2, 10), pack_rows(torch.randn(8, 6), torch.int8), 8)
    with pytest.raises(ValueError, match="rows_weight: "):
        rows_weight(packed, 8)
    for dtype in (torch.float16, torch.bfloat16):
        with pytest.raises(ValueError, match="pack_rows: dtype"):
            pack_rows(torch.randn(8, 6), dtype)


def test_linear_leaves_many_rows_and_more_threads_to_aten():
    w, b = torch.randn(24, 16), torch.randn(24)
    packed, few, many = pack_rows(w), torch.randn(2, 3, 16), torch.randn(ROWS_MAX + 1, 16)
    assert_unchanged("few rows: rows_mm", rows_mm(few.reshape(6, 16), packed, 24).view(2, 3, 24) + b,
                     linear(few, w, b, packed))
    assert_unchanged("many rows: ATen", F.linear(many, w, b), linear(many, w, b, packed))
    assert_unchanged("no packed copy: ATen", F.linear(few, w, b), linear(few, w, b))
    torch.set_num_threads(2)
    try:
        assert_unchanged("two threads: ATen", F.linear(few, w, b), linear(few, w, b, packed))
    finally:
        torch.set_num_threads(1)


def test_an_int8_copy_reads_its_weight_at_int8_in_every_call():
    """A drafter's int8 copy: a step's rows (here 18, more than ROWS_MAX) in rows_mm at any thread count, a prompt's
    through ATen over the weight at int8 levels, so each call computes the product by the rounded weight."""
    w, b = torch.randn(24, 16), torch.randn(24)
    packed, rounded, few, many = pack_rows(w, torch.int8), int8_rounded(w), torch.randn(2, 9, 16), \
        torch.randn(DRAFT_ROWS_MAX + 1, 16)
    in_c = rows_mm(few.reshape(18, 16), packed, 24).view(2, 9, 24) + b
    assert_unchanged("few rows: rows_mm", in_c, linear(few, w, b, packed))
    assert_close("few rows: the rounded weight", F.linear(few, rounded, b), in_c, atol=1e-5)
    assert_close("many rows: ATen over the rounded weight", F.linear(many, rounded, b), linear(many, w, b, packed),
                 atol=1e-5)
    assert_unchanged("many rows in the op: ATen as linear", linear(many, w, None, packed), rows_linear(many, packed, w))
    traced = torch.compile(lambda x: linear(x, w, b, packed), backend="eager", fullgraph=True)  # fake tensors
    assert_unchanged("many rows in a graph", linear(many, w, b, packed), traced(many))
    torch.set_num_threads(2)
    try:
        assert_unchanged("two threads: still rows_mm", in_c, linear(few, w, b, packed))
    finally:
        torch.set_num_threads(1)


def one_block(tensors) -> bool:
    """The tensors lie back to back (64-byte aligned) from a 2 MB boundary: on_huge_pages' block."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.numel())
    return spans[0][0] % HUGE_PAGE == 0 and all(0 <= nxt - end < 64 for (_, end), (nxt, _) in zip(spans, spans[1:]))


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages on this OS")
def test_on_huge_pages_copies_into_one_aligned_block():
    """Exact copies of any dtype and layout, back to back from a 2 MB boundary, each its own storage (offset 0) that
    keeps the mapping alive; a dense tensor keeps its strides (an input-major weight), one with gaps comes back
    contiguous; a write to a copy leaves its original and the other copies alone."""
    tensors = [torch.randn(3, 5), torch.randn(7, dtype=torch.float64), torch.randint(0, 255, (13,), dtype=torch.uint8),
               pack_rows(torch.randn(70, 40)), torch.randn(2, 3, 4).transpose(0, 2), torch.randn(4, 6).t().unsqueeze(1),
               torch.randn(9, 8)[:, ::2]]
    copies = list(on_huge_pages(tensors))
    gc.collect()  # the mapping's Python object is gone: the copies hold it
    for i, (want, got) in enumerate(zip(tensors, copies)):
        assert_unchanged(f"copy {i}", want, got)
        assert got.storage_offset() == 0 and got.untyped_storage().nbytes() == got.nbytes, i
        assert got.stride() == (want.stride() if i < len(tensors) - 1 else want.contiguous().stride()), i
    assert one_block(copies) and copies[0].data_ptr() % HUGE_PAGE == 0
    copies[0].zero_()
    assert tensors[0].abs().sum() > 0 and copies[1].equal(tensors[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_for_inference_moves_the_weights_onto_one_block(dtype):
    """The state dict keeps its Parameters and their values bit for bit; fp32 linear weights turn input-major, bf16
    ones keep their layout; every weight, the fused q/k/v too, lies in one storage; the logits stay the model's."""
    model = tiny_model().to(dtype)
    before = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    params = dict(model.named_parameters())
    ids = torch.randint(0, model.cfg.vocab_size, (1, 5))
    with torch.no_grad():
        ref = model(ids)
        model.for_inference()
        out = model(ids)
    for name, p in model.named_parameters():
        assert p is params[name]
        assert_unchanged(name, before[name], p.detach())
    linear_weight = model.model.layers[0].shared_mlp.input_linear.weight
    assert linear_weight.stride() == ((1, linear_weight.shape[0]) if dtype == torch.float32 else (linear_weight.shape[1], 1))
    fused = [m.qkv_weight for m in model.modules() if getattr(m, "qkv_weight", None) is not None]
    assert fused and one_block([*model.parameters(), *fused]) == hasattr(mmap, "MADV_HUGEPAGE")
    assert_close("logits", ref.float(), out.float(), atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_pack_linears_keeps_the_weights_and_computes_what_aten_does(tied):
    """The state dict is the same tensors under the same names; every linear, the fused q/k/v and a tied head
    are packed; the logits of a few rows through the packed network match ATen's; the embedding table, input-major
    for ATen's products, lies row by row with its values (an untied one always did); a bf16 network is left alone."""
    model = tiny_model(tie_word_embeddings=tied).for_inference()
    before = model.state_dict(keep_vars=True)
    table = model.model.embed_tokens.weight
    assert table.is_contiguous() != tied
    values = table.detach().clone()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 5))
    with torch.no_grad():
        ref = model(ids)
        pack_linears(model)
        out = model(ids)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, RowsLinear) for m in model.modules()) > 0 and (model.head_packed is not None) == tied
    assert all(m.qkv_packed is not None for m in model.modules() if hasattr(m, "qkv_packed"))
    packed = [t for name, t in model.named_buffers() if "packed" in name] + [model.head_packed] * tied
    assert one_block(set(packed)) == hasattr(mmap, "MADV_HUGEPAGE")
    assert_close("logits", ref, out, atol=1e-5)
    assert table.is_contiguous() and one_block([table]) == hasattr(mmap, "MADV_HUGEPAGE")
    assert_unchanged("the embedding table", values, table.detach())
    half = tiny_model().bfloat16()
    pack_linears(half)
    assert not any(isinstance(m, RowsLinear) for m in half.modules()) and half.head_packed is None


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_a_drafters_weights_pack_in_int8_beside_the_targets_fp32(tied):
    """A compiled step's packing with an MTP drafter: the target's weights (skipping the head's layer) in fp32,
    the head's layer and the drafts' output layer (DraftHead) in int8. The target's logits are its own; the draft
    logits are the model's with every weight the drafts read rounded to int8 levels."""
    from nano_spec.model.model import DraftHead

    model = tiny_model(tie_word_embeddings=tied).for_inference()
    head = DraftHead(model)
    drafts = (model.mtp, head)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 5))
    with torch.no_grad():
        ref_target = model(ids)
        o = torch.randn(3, model.cfg.hidden_size)
        rounded = tiny_model(tie_word_embeddings=tied).for_inference()
        for p in rounded.mtp.parameters():  # the head's products at int8 (not its norms, nor the embedding lookup)
            if p.dim() == 2:
                p.copy_(int8_rounded(p))
        for m in rounded.mtp.modules():
            if getattr(m, "qkv_weight", None) is not None:
                m.fuse_qkv()
        out_weight = int8_rounded(rounded.tied_head if tied else rounded.lm_head.weight)
        x = torch.randint(0, model.cfg.vocab_size, (3, 1))
        ref_draft = rounded.mtp_logits(rounded.mtp_hidden(x, o[:, None])[:, 0],
                                       lambda y: F.linear(y, out_weight) / rounded.cfg.logits_scaling)
        pack_linears(model, skip=drafts)
        for net in drafts:
            pack_linears(net, torch.int8)
        out_target, out_draft = model(ids), model.mtp_logits(model.mtp_hidden(x, o[:, None])[:, 0], head)
    dtypes = {name: t.dtype for name, t in model.named_buffers() if "packed" in name}
    assert dtypes and all(d == (torch.int8 if n.startswith("mtp.") else torch.float32) for n, d in dtypes.items())
    assert head.packed.dtype == torch.int8 and (model.head_packed is not None) == tied
    assert_close("target logits", ref_target, out_target, atol=1e-5)
    assert_close("draft logits", ref_draft, out_draft, atol=1e-5)
