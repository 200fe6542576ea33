"""Attention kernels vs their references (Triton interpreter on the CPU, fp32).

Every test runs the reference on a clone of the caches and compares the outputs
(assert_close) and the written cache rows; every row a kernel must not write is
compared bit-for-bit with its value before the call (assert_unchanged).
"""
import pytest
import torch

from nano_spec_kernels.attention_prefill import attention_prefill, attention_prefill_ref
import torch.nn.functional as F

from nano_spec_kernels.attention_verify import (attention_block, attention_block_plan, attention_block_ref,
                                                attention_verify, attention_verify_plan, attention_verify_ref)
from nano_spec_kernels.common import apply_rope_ref, launch
from helpers import assert_close, assert_refuses, assert_unchanged

SCALE = 0.37  # deliberately not 1/sqrt(Dh): the kernels must use the given scale
ERRS: dict[str, float] = {}  # largest error per kernel, printed at the end of the module


def _record(name, err):
    ERRS[name] = max(ERRS.get(name, 0.0), err)


@pytest.fixture(scope="module", autouse=True)
def _print_errors():
    yield
    print("\nmax abs err vs reference: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(ERRS.items())))


def _cache(S, L, Hkv, Dh, device):
    # random (not zero) contents so a stray write or a read of an unwritten row shows up
    return torch.randn(S, L, Hkv, Dh, device=device), torch.randn(S, L, Hkv, Dh, device=device)


# ---------------------------------------------------------------- prefill

PREFILL_CASES = [
    pytest.param(1, 1, 1, 24, None, id="T1-Hq1-Hkv1-Dh24-nope"),
    pytest.param(63, 4, 2, 24, 10000.0, id="T63-Hq4-Hkv2-Dh24-rope"),
    pytest.param(63, 2, 2, 16, None, id="T63-Hq2-Hkv2-Dh16-nope"),
    pytest.param(200, 4, 1, 32, 10000.0, id="T200-Hq4-Hkv1-Dh32-rope"),
    pytest.param(200, 2, 1, 24, None, id="T200-Hq2-Hkv1-Dh24-nope"),
]


@pytest.mark.parametrize("T, Hq, Hkv, Dh, theta", PREFILL_CASES)
def test_attention_prefill_matches_reference(device, T, Hq, Hkv, Dh, theta):
    S, L, slot = 3, 256, 1
    q = torch.randn(T, Hq, Dh, device=device)
    k = torch.randn(T, Hkv, Dh, device=device)
    v = torch.randn(T, Hkv, Dh, device=device)
    kc, vc = _cache(S, L, Hkv, Dh, device)
    kc0, vc0 = kc.clone(), vc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()

    o = attention_prefill(q, k, v, kc, vc, slot, SCALE, theta)
    o_ref = attention_prefill_ref(q, k, v, kc_ref, vc_ref, slot, SCALE, theta)

    _record("attention_prefill", assert_close("o", o_ref, o))
    _record("attention_prefill k_cache", assert_close("k_cache rows", kc_ref[slot, :T], kc[slot, :T]))
    assert_unchanged("v_cache rows", vc_ref[slot, :T], vc[slot, :T])  # a plain copy: exact
    for s in range(S):
        lo = T if s == slot else 0
        assert_unchanged(f"k_cache slot {s} rows {lo}:", kc0[s, lo:], kc[s, lo:])
        assert_unchanged(f"v_cache slot {s} rows {lo}:", vc0[s, lo:], vc[s, lo:])


def test_attention_prefill_strided_inputs(device):
    """q, k, v as views of one fused qkv projection (row stride != Hq * Dh)."""
    T, Hq, Hkv, Dh = 40, 4, 2, 24
    qkv = torch.randn(T, (Hq + 2 * Hkv) * Dh, device=device)
    q, k, v = qkv.split([Hq * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
    q, k, v = q.view(T, Hq, Dh), k.view(T, Hkv, Dh), v.view(T, Hkv, Dh)
    kc, vc = _cache(2, 64, Hkv, Dh, device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    o = attention_prefill(q, k, v, kc, vc, 0, SCALE, 500.0)
    o_ref = attention_prefill_ref(q, k, v, kc_ref, vc_ref, 0, SCALE, 500.0)
    _record("attention_prefill", assert_close("o", o_ref, o))
    _record("attention_prefill k_cache", assert_close("k_cache", kc_ref, kc))


# ---------------------------------------------------------------- verify

VERIFY_CASES = [
    # B, K, Hq, Hkv, Dh, theta, L, num_splits (None = the launcher's choice)
    pytest.param(3, 1, 2, 1, 24, None, 100, None, id="B3-K1-Hq2-Hkv1-Dh24-nope"),
    pytest.param(3, 4, 4, 2, 24, 10000.0, 200, None, id="B3-K4-Hq4-Hkv2-Dh24-rope"),
    pytest.param(2, 5, 4, 1, 32, 10000.0, 256, 3, id="B2-K5-Hq4-Hkv1-Dh32-rope-3splits"),
    pytest.param(4, 2, 2, 2, 16, None, 64, 1, id="B4-K2-Hq2-Hkv2-Dh16-nope-1split"),
    pytest.param(5, 3, 1, 1, 24, 10000.0, 130, 4, id="B5-K3-Hq1-Hkv1-Dh24-rope-4splits"),
]


@pytest.mark.parametrize("Bsz, K, Hq, Hkv, Dh, theta, L, splits", VERIFY_CASES)
def test_attention_verify_matches_reference(device, Bsz, K, Hq, Hkv, Dh, theta, L, splits):
    S = Bsz + 2
    q = torch.randn(Bsz, K, Hq, Dh, device=device)
    k = torch.randn(Bsz, K, Hkv, Dh, device=device)
    v = torch.randn(Bsz, K, Hkv, Dh, device=device)
    # the full cache has more rows than the view the kernel gets (k_cache[:, :L], non-contiguous)
    kc, vc = _cache(S, L + 9, Hkv, Dh, device)
    kc0, vc0 = kc.clone(), vc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slots = torch.randperm(S, device=device)[:Bsz]
    lens = torch.randint(0, L - K + 1, (Bsz,), device=device)
    lens[0] = L - K  # one sequence fills the view exactly
    if Bsz > 2:
        lens[1] = 0  # and one starts from an empty cache

    o = launch(attention_verify_plan, q, k, v, kc[:, :L], vc[:, :L], slots, lens, SCALE, theta, num_splits=splits)
    o_ref = attention_verify_ref(q, k, v, kc_ref[:, :L], vc_ref[:, :L], slots, lens, SCALE, theta)

    _record("attention_verify", assert_close("o", o_ref, o))
    written = torch.zeros(S, L + 9, dtype=torch.bool, device=device)
    for b in range(Bsz):
        s, n = int(slots[b]), int(lens[b])
        written[s, n : n + K] = True
        _record("attention_verify k_cache", assert_close(f"k_cache b{b}", kc_ref[s, n : n + K], kc[s, n : n + K]))
        assert_unchanged(f"v_cache b{b}", vc_ref[s, n : n + K], vc[s, n : n + K])
    assert_unchanged("k_cache rows not written", kc0[~written], kc[~written])
    assert_unchanged("v_cache rows not written", vc0[~written], vc[~written])


@pytest.mark.parametrize("theta", [None, 10000.0], ids=["nope", "rope"])
def test_attention_verify_k_rows_equal_k_single_row_calls(device, theta):
    Bsz, K, Hq, Hkv, Dh, L = 3, 4, 4, 2, 24, 96
    q = torch.randn(Bsz, K, Hq, Dh, device=device)
    k = torch.randn(Bsz, K, Hkv, Dh, device=device)
    v = torch.randn(Bsz, K, Hkv, Dh, device=device)
    kc, vc = _cache(Bsz, L, Hkv, Dh, device)
    kc1, vc1 = kc.clone(), vc.clone()
    slots = torch.tensor([2, 0, 1], device=device)
    lens = torch.tensor([5, 60, 0], device=device)

    o_all = attention_verify(q, k, v, kc, vc, slots, lens, SCALE, theta)
    o_one = torch.cat([
        attention_verify(q[:, j : j + 1], k[:, j : j + 1], v[:, j : j + 1], kc1, vc1, slots, lens + j, SCALE, theta)
        for j in range(K)
    ], dim=1)
    assert_close("K rows vs K single rows", o_one, o_all, atol=1e-5)
    assert_close("k_cache", kc1, kc, atol=1e-6)
    assert_unchanged("v_cache", vc1, vc)


def test_prefill_then_verify_equals_longer_prefill(device):
    """Prefill T rows then verify K rows = a prefill of T + K rows (same cache, same outputs)."""
    T, K, Hq, Hkv, Dh, theta = 37, 3, 4, 2, 24, 10000.0
    q = torch.randn(T + K, Hq, Dh, device=device)
    k = torch.randn(T + K, Hkv, Dh, device=device)
    v = torch.randn(T + K, Hkv, Dh, device=device)
    kc, vc = _cache(2, 64, Hkv, Dh, device)
    kc_full, vc_full = kc.clone(), vc.clone()
    o_full = attention_prefill(q, k, v, kc_full, vc_full, 1, SCALE, theta)
    attention_prefill(q[:T], k[:T], v[:T], kc, vc, 1, SCALE, theta)
    o_step = attention_verify(q[None, T:], k[None, T:], v[None, T:], kc, vc, torch.tensor([1], device=device),
                              torch.tensor([T], device=device), SCALE, theta)
    assert_close("verify rows vs prefill rows", o_full[T:], o_step[0], atol=1e-5)
    assert_close("k_cache", kc_full, kc, atol=1e-5)


# ---------------------------------------------------------------- block (non-causal, cache read only)

BLOCK_CASES = [
    # B, Kb, Hq, Hkv, Dh, theta, L, num_splits (None = the launcher's choice)
    pytest.param(3, 1, 4, 2, 16, None, 50, None, id="B3-Kb1-Hq4-Hkv2-Dh16-nope"),
    pytest.param(3, 3, 3, 3, 24, 10000.0, 70, None, id="B3-Kb3-Hq3-Hkv3-Dh24-rope"),
    pytest.param(4, 8, 4, 2, 24, 10000.0, 100, 3, id="B4-Kb8-Hq4-Hkv2-Dh24-rope-3splits"),
    pytest.param(2, 8, 3, 3, 16, None, 45, 1, id="B2-Kb8-Hq3-Hkv3-Dh16-nope-1split"),
    pytest.param(3, 3, 4, 2, 16, 500.0, 130, 4, id="B3-Kb3-Hq4-Hkv2-Dh16-rope-4splits"),
]


@pytest.mark.parametrize("Bsz, Kb, Hq, Hkv, Dh, theta, L, splits", BLOCK_CASES)
def test_attention_block_matches_reference(device, Bsz, Kb, Hq, Hkv, Dh, theta, L, splits):
    S = Bsz + 2
    q = torch.randn(Bsz, Kb, Hq, Dh, device=device)
    k = torch.randn(Bsz, Kb, Hkv, Dh, device=device)
    v = torch.randn(Bsz, Kb, Hkv, Dh, device=device)
    # the kernel gets a view of the first L rows (non-contiguous); the rows past it must stay unseen and unwritten
    kc, vc = _cache(S, L + 9, Hkv, Dh, device)
    kc0, vc0 = kc.clone(), vc.clone()
    slots = torch.randperm(S, device=device)[:Bsz]
    lens = torch.randint(1, L, (Bsz,), device=device)
    lens[0] = L  # the context fills the view
    lens[1] = 0  # no context: the block attends to itself alone
    if Bsz > 2:
        lens[2] = 37  # not a multiple of Kb nor of the key block

    o = launch(attention_block_plan, q, k, v, kc[:, :L], vc[:, :L], slots, lens, SCALE, theta, num_splits=splits)
    o_ref = attention_block_ref(q, k, v, kc0[:, :L], vc0[:, :L], slots, lens, SCALE, theta)

    _record("attention_block", assert_close("o", o_ref, o))
    assert_unchanged("k_cache", kc0, kc)
    assert_unchanged("v_cache", vc0, vc)


def test_attention_block_reference_equals_sdpa(device):
    """The reference against torch's own attention, per sequence: the gathered context rows, then the rotated
    block rows, every query row seeing all of them (no mask), GQA by sdpa's enable_gqa."""
    Bsz, Kb, Hq, Hkv, Dh, L, theta = 3, 4, 4, 2, 16, 24, 10000.0
    q = torch.randn(Bsz, Kb, Hq, Dh, device=device)
    k = torch.randn(Bsz, Kb, Hkv, Dh, device=device)
    v = torch.randn(Bsz, Kb, Hkv, Dh, device=device)
    kc, vc = _cache(4, L, Hkv, Dh, device)
    slots, lens = torch.tensor([3, 0, 1], device=device), torch.tensor([11, 0, L], device=device)
    o_ref = attention_block_ref(q, k, v, kc, vc, slots, lens, SCALE, theta)
    for b in range(Bsz):
        s, n = int(slots[b]), int(lens[b])
        pos = n + torch.arange(Kb, device=device)
        keys = torch.cat((kc[s, :n], apply_rope_ref(k[b], pos, theta)))  # (n + Kb, Hkv, Dh)
        vals = torch.cat((vc[s, :n], v[b]))
        qb = apply_rope_ref(q[b], pos, theta)
        o_sdpa = F.scaled_dot_product_attention(qb.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                                scale=SCALE, enable_gqa=True).transpose(0, 1)  # (Kb, Hq, Dh)
        assert_close(f"reference vs sdpa b{b}", o_sdpa, o_ref[b], atol=1e-5)


def test_attention_block_one_row_equals_verify(device):
    """Kb = 1: a block of one row sees the context and itself, as a verify step of one row does."""
    Bsz, Hq, Hkv, Dh, L, theta = 3, 4, 2, 24, 40, 10000.0
    q = torch.randn(Bsz, 1, Hq, Dh, device=device)
    k = torch.randn(Bsz, 1, Hkv, Dh, device=device)
    v = torch.randn(Bsz, 1, Hkv, Dh, device=device)
    kc, vc = _cache(Bsz, L, Hkv, Dh, device)
    slots, lens = torch.tensor([1, 2, 0], device=device), torch.tensor([0, 13, L - 1], device=device)
    o_block = attention_block(q, k, v, kc, vc, slots, lens, SCALE, theta)
    o_verify = attention_verify(q, k, v, kc.clone(), vc.clone(), slots, lens, SCALE, theta)
    assert_close("block of one row vs verify of one row", o_verify, o_block, atol=1e-5)


def test_attention_block_half_precision(device):
    """fp16 (the interpreter's bf16 dot is not usable on CPU): within fp16 rounding of the reference."""
    dt = torch.float16
    Hq, Hkv, Dh = 4, 2, 24
    q, k, v = (torch.randn(2, 5, h, Dh, device=device, dtype=dt) for h in (Hq, Hkv, Hkv))
    kc, vc = (torch.randn(3, 40, Hkv, Dh, device=device).to(dt) for _ in range(2))
    kc0, vc0 = kc.clone(), vc.clone()
    slots, lens = torch.tensor([2, 0], device=device), torch.tensor([33, 6], device=device)
    o = attention_block(q, k, v, kc, vc, slots, lens, SCALE, 10000.0)
    o_ref = attention_block_ref(q, k, v, kc0, vc0, slots, lens, SCALE, 10000.0)
    assert_close("block o fp16", o_ref, o, atol=5e-3)
    assert_unchanged("k_cache fp16", kc0, kc)
    assert_unchanged("v_cache fp16", vc0, vc)


# ---------------------------------------------------------------- launcher checks

def test_attention_prefill_rejects_bad_shapes(device):
    with torch.device(device):  # the tensors made below live on the device under test, as the engine's do
        q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
        kc, vc = _cache(2, 16, 2, 16, device)
        with pytest.raises(ValueError, match="k, v"):
            attention_prefill(q, k[:7], v, kc, vc, 0, SCALE)
        with pytest.raises(ValueError, match="multiple"):
            attention_prefill(torch.randn(8, 3, 16), k, v, kc, vc, 0, SCALE)
        with pytest.raises(ValueError, match="k_cache"):
            attention_prefill(q, k, v, kc[:, :, :1], vc[:, :, :1], 0, SCALE)
        with pytest.raises(ValueError, match="slot"):
            attention_prefill(q, k, v, kc, vc, 2, SCALE)
        with pytest.raises(ValueError, match="fit"):
            attention_prefill(q, k, v, kc[:, :4], vc[:, :4], 0, SCALE)
        with pytest.raises(ValueError, match="dtype"):
            attention_prefill(q.double(), k, v, kc, vc, 0, SCALE)
        with pytest.raises(ValueError, match="even"):
            attention_prefill(torch.randn(8, 4, 15), torch.randn(8, 2, 15), torch.randn(8, 2, 15),
                              torch.randn(2, 16, 2, 15), torch.randn(2, 16, 2, 15), 0, SCALE, 10000.0)


def test_attention_verify_rejects_bad_shapes(device):
    with torch.device(device):  # the tensors made below live on the device under test, as the engine's do
        q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
        kc, vc = _cache(3, 32, 2, 16, device)
        slots, lens = torch.tensor([0, 2]), torch.tensor([4, 9])
        with pytest.raises(ValueError, match="k, v"):
            attention_verify(q, k[:, :2], v, kc, vc, slots, lens, SCALE)
        with pytest.raises(ValueError, match="slot_ids"):
            attention_verify(q, k, v, kc, vc, slots[:1], lens, SCALE)
        with pytest.raises(ValueError, match="integer"):
            attention_verify(q, k, v, kc, vc, slots, lens.float(), SCALE)
        with pytest.raises(ValueError, match="attention_verify: slot_ids, seq_lens must be contiguous"):
            attention_verify(q, k, v, kc, vc, slots, torch.tensor([[4, 0], [9, 0]])[:, 0], SCALE)
        with pytest.raises(ValueError, match="k_cache"):
            attention_verify(q, k, v, kc[..., :8], vc[..., :8], slots, lens, SCALE)
        with pytest.raises(ValueError, match="unit stride"):
            attention_verify(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, kc, vc, slots, lens, SCALE)


def test_attention_block_rejects_bad_shapes(device):
    with torch.device(device):  # the tensors made below live on the device under test, as the engine's do
        q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
        kc, vc = _cache(3, 32, 2, 16, device)
        slots, lens = torch.tensor([0, 2]), torch.tensor([4, 32])
        with pytest.raises(ValueError, match="attention_block: Hq=3 must be a multiple of Hkv=2"):
            attention_block(torch.randn(2, 3, 3, 16), k, v, kc, vc, slots, lens, SCALE)
        with pytest.raises(ValueError, match="attention_block: Kb=0 block rows"):
            attention_block(q[:, :0], k[:, :0], v[:, :0], kc, vc, slots, lens, SCALE)
        with pytest.raises(ValueError, match="attention_block: RoPE needs an even head dim"):
            attention_block(q[..., :15], k[..., :15], v[..., :15], kc[..., :15], vc[..., :15], slots, lens, SCALE, 1e4)
        # a block longer than the cache view is fine: its rows are never stored
        o = attention_block(torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2, 16),
                            kc[:, :4], vc[:, :4], slots, torch.tensor([4, 0]), SCALE)
        assert o.shape == (2, 5, 4, 16)


def test_attention_half_precision(device):
    """fp16 (the half-precision tl.dot path; the interpreter's bf16 dot is not usable on CPU):
    within fp16 rounding of the reference, and the same cache rows."""
    dt = torch.float16
    T, Hq, Hkv, Dh, theta = 40, 4, 2, 24, 10000.0
    q, k, v = (torch.randn(T, h, Dh, device=device, dtype=dt) for h in (Hq, Hkv, Hkv))
    kc, vc = (torch.randn(2, 64, Hkv, Dh, device=device).to(dt) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    o = attention_prefill(q, k, v, kc, vc, 1, SCALE, theta)
    o_ref = attention_prefill_ref(q, k, v, kc_ref, vc_ref, 1, SCALE, theta)
    assert_close("prefill o fp16", o_ref, o, atol=5e-3)
    assert_close("prefill k_cache fp16", kc_ref, kc, atol=5e-3)
    qv, kv, vv = (torch.randn(2, 3, h, Dh, device=device, dtype=dt) for h in (Hq, Hkv, Hkv))
    slots, lens = torch.tensor([1, 0], device=device), torch.tensor([T, 7], device=device)
    o = attention_verify(qv, kv, vv, kc, vc, slots, lens, SCALE, theta)
    o_ref = attention_verify_ref(qv, kv, vv, kc_ref, vc_ref, slots, lens, SCALE, theta)
    assert_close("verify o fp16", o_ref, o, atol=5e-3)
    assert_close("verify k_cache fp16", kc_ref, kc, atol=5e-3)
    assert_unchanged("verify v_cache fp16", vc_ref, vc)


LAUNCHERS = {  # launcher, valid keyword arguments on a device
    "attention_prefill": (attention_prefill, lambda d: dict(
        q=torch.randn(8, 4, 16, device=d), k=torch.randn(8, 2, 16, device=d), v=torch.randn(8, 2, 16, device=d),
        k_cache=torch.randn(2, 16, 2, 16, device=d), v_cache=torch.randn(2, 16, 2, 16, device=d), slot=0, scale=SCALE)),
    "attention_verify": (attention_verify, lambda d: dict(
        q=torch.randn(2, 3, 4, 16, device=d), k=torch.randn(2, 3, 2, 16, device=d),
        v=torch.randn(2, 3, 2, 16, device=d), k_cache=torch.randn(3, 32, 2, 16, device=d),
        v_cache=torch.randn(3, 32, 2, 16, device=d), slot_ids=torch.tensor([0, 2], device=d),
        seq_lens=torch.tensor([4, 9], device=d), scale=SCALE)),
    "attention_block": (attention_block, lambda d: dict(
        q=torch.randn(2, 3, 4, 16, device=d), k=torch.randn(2, 3, 2, 16, device=d),
        v=torch.randn(2, 3, 2, 16, device=d), k_cache=torch.randn(3, 32, 2, 16, device=d),
        v_cache=torch.randn(3, 32, 2, 16, device=d), slot_ids=torch.tensor([0, 2], device=d),
        ctx_lens=torch.tensor([4, 9], device=d), scale=SCALE)),
}
REFUSALS = [  # launcher, argument, fault (prefill takes no argument that must be contiguous)
    ("attention_prefill", "k", "shape"), ("attention_prefill", "v_cache", "dtype"),
    ("attention_prefill", "q", "stride"), ("attention_prefill", "k_cache", "device"),
    ("attention_verify", "slot_ids", "shape"), ("attention_verify", "q", "dtype"),
    ("attention_verify", "seq_lens", "noncontig"), ("attention_verify", "v", "stride"),
    ("attention_verify", "k_cache", "device"),
    ("attention_block", "k", "shape"), ("attention_block", "v_cache", "dtype"),
    ("attention_block", "ctx_lens", "noncontig"), ("attention_block", "q", "stride"),
    ("attention_block", "slot_ids", "device"),
]


@pytest.mark.parametrize("kernel, arg, fault", REFUSALS, ids=["-".join(c) for c in REFUSALS])
def test_launchers_name_the_bad_argument(device, kernel, arg, fault):
    """One argument wrong in one way: a ValueError naming the kernel, the argument and what is wrong."""
    launcher, inputs = LAUNCHERS[kernel]
    assert_refuses(kernel, launcher, inputs(device), arg, fault)
