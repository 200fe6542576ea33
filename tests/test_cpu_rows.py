"""The compiled CPU step's Mamba verify (graph_ops.mamba_verify, its recurrence in cpu_rows' C kernel) against
the torch reference mamba_verify_ref, called outside a graph: the stash and the states bit for bit, y to 1e-4,
the slots it must not touch unchanged; and the kernel alone computes every row as a one-row call does."""
import pytest
import torch

from helpers import assert_close, assert_unchanged
from nano_spec.model.cpu_rows import mamba_rows
from nano_spec.model.graph_ops import mamba_verify
from nano_spec_kernels.mamba_verify import mamba_verify_ref
from test_kernels_mamba import INF, S, SLOTS, VERIFY_CASES, make_layer, run_verify, slot_ids

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
        assert_unchanged(name, r, o)
    untouched = [s for s in range(S) if s not in SLOTS[:Bsz]]
    assert_unchanged("conv_state of other slots", conv_state[untouched], out[1][untouched])
    assert_unchanged("ssm_state of other slots", ssm_state[untouched], out[2][untouched])


def rows_inputs(Bsz, K, H, P, N, G):
    """mamba_rows' inputs in their ranges: decay in (0, 1), u = dt x, B and C."""
    return torch.rand(Bsz, K, H) * 0.98 + 0.01, torch.randn(Bsz, K, H, P), torch.randn(Bsz, K, G, N), \
        torch.randn(Bsz, K, G, N)


@pytest.mark.parametrize("K", [2, 4, 5], ids=lambda k: f"K{k}")
def test_k_rows_equal_k_one_row_calls(K):
    """Row j of a K-row call is what a 1-row call from the state after row j-1 gives, y included, bit for bit:
    y's sum over N runs in the same order whatever K (the kernel's part of spec = plain; the graph's own
    elementwise ops around it are inductor's)."""
    Bsz, H, P, N, G = 3, 4, 12, 37, 2
    decay, u, Bm, Cm = rows_inputs(Bsz, K, H, P, N, G)
    state = torch.randn(S, H, P, N)
    slots, stash, one_state = slot_ids(Bsz), torch.empty(Bsz, K, H, P, N), state.clone()
    y = mamba_rows(state, stash, slots, decay, u, Bm, Cm)
    for j in range(K):
        row = slice(j, j + 1)
        stash1 = torch.empty(Bsz, 1, H, P, N)
        y1 = mamba_rows(one_state, stash1, slots, decay[:, row], u[:, row], Bm[:, row], Cm[:, row])
        assert_unchanged(f"y row {j}", y[:, row], y1)
        assert_unchanged(f"ssm_stash row {j}", stash[:, row], stash1)
    assert_unchanged("ssm_state", state, one_state)


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
    with pytest.raises(ValueError, match=r"slot_ids \[0, 7\] must lie in \[0, 7\)"):
        mamba_rows(state, stash, torch.tensor([0, S]), *rows_inputs(Bsz, K, H, P, N, G))
    assert_unchanged("ssm_state", before, state)
    assert not stash.any()


def test_a_state_of_another_layout_is_refused():
    Bsz, K, H, P, N, G = 1, 2, 4, 12, 20, 2
    with pytest.raises(ValueError, match="mamba_rows: ssm_state must be fp32"):
        mamba_rows(torch.randn(S, H, N, P).transpose(2, 3), torch.zeros(Bsz, K, H, P, N), slot_ids(Bsz),
                   *rows_inputs(Bsz, K, H, P, N, G))


def test_the_library_is_built_whole_into_its_cache(tmp_path, monkeypatch):
    """A build leaves one library in the cache directory and nothing half-written; a compiler that fails is a
    RuntimeError with its message, not a library that is missing later."""
    from nano_spec.model.cpu_rows import library

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert library.__wrapped__().mamba_rows is not None  # __wrapped__: past the per-process cache
    built = list((tmp_path / "nano_spec").iterdir())
    assert len(built) == 1 and built[0].name.startswith("mamba_rows_") and built[0].suffix == ".so"
    monkeypatch.setenv("CC", "false")  # exits 1: another compiler, another key, so it must build
    with pytest.raises(RuntimeError, match="compile: false could not build the CPU Mamba kernel"):
        library.__wrapped__()
    assert len(list((tmp_path / "nano_spec").iterdir())) == 1
