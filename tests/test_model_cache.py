"""The cached entry points against the no-cache forward and against each other (docs/DESIGN.md §6)."""
import pytest
import torch

from helpers import assert_close, assert_unchanged, mtp_kv, tiny_model
from nano_spec.model.cache import HybridCache

SLOTS = [4, 1, 2]  # non-contiguous, out of order


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def prefilled(model, prompts, max_k=5):
    cache = HybridCache(model.cfg, num_slots=6, max_seq_len=48, max_k=max_k)
    for slot, p in zip(SLOTS, prompts):
        model.prefill(p, slot, cache)
    return cache


def prompts_and_rows(K, lens=(7, 3, 11)):
    g = torch.Generator().manual_seed(K)
    prompts = [torch.randint(0, 67, (n,), generator=g) for n in lens]
    rows = torch.randint(0, 67, (len(lens), K), generator=g)
    return prompts, rows


@torch.no_grad()
def test_prefill_then_decode_equals_forward(model):
    ids = torch.randint(0, 67, (1, 20))
    ref = model(ids)[0]  # (T, V)
    cache = HybridCache(model.cfg, 3, 32, 1)
    y = model.prefill(ids[0, :6], 2, cache)
    assert_close("prefill logits", ref[:6], model.logits(y))
    for t in range(6, 20):
        lg = model.verify(ids[:, t : t + 1], torch.tensor([2]), torch.tensor([t]), cache)
        assert_close(f"decode logits t={t}", ref[t], lg[0, 0])


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5], ids=lambda k: f"K{k}")
@torch.no_grad()
def test_verify_k_rows_equals_k_single_rows(model, K):
    prompts, rows = prompts_and_rows(K)
    slot_ids, seq_lens = torch.tensor(SLOTS), torch.tensor([len(p) for p in prompts])
    multi = prefilled(model, prompts)
    lg_multi = model.verify(rows, slot_ids, seq_lens, multi)
    ssm_stash = multi.ssm_stash(3, K).clone()
    conv_stash = multi.conv_stash(3, K).clone()
    hidden = multi.hidden_stash(3, K).clone()

    single = prefilled(model, prompts)
    W = model.cfg.mamba_d_conv
    for j in range(K):
        lg = model.verify(rows[:, j : j + 1], slot_ids, seq_lens + j, single)
        assert_close(f"logits row {j}", lg[:, 0], lg_multi[:, j])
        assert_close(f"ssm_stash row {j}", single.ssm_state[:, SLOTS], ssm_stash[:, :, j])
        assert_close(f"hidden_stash row {j}", single.hidden_stash(3, 1)[:, 0], hidden[:, j])
        # the window after row j is stash columns j+1 .. j+W-1
        assert_close(f"conv_stash window {j}", single.conv_state[:, SLOTS], conv_stash[..., j + 1 : j + W])
    assert_close("live ssm state", single.ssm_state, multi.ssm_state)
    assert_close("live conv state", single.conv_state, multi.conv_state)
    assert_close("KV cache", single.k, multi.k)


@pytest.mark.parametrize("na", [0, 1, 2, 3], ids=lambda n: f"na{n}")
@torch.no_grad()
def test_commit_equals_verify_of_accepted_rows(model, na):
    K = 4
    prompts, rows = prompts_and_rows(K)
    slot_ids, seq_lens = torch.tensor(SLOTS), torch.tensor([len(p) for p in prompts])
    spec = prefilled(model, prompts)
    model.verify(rows, slot_ids, seq_lens, spec)
    untouched_slots = [s for s in range(6) if s not in SLOTS]
    before = spec.ssm_state[:, untouched_slots].clone(), spec.conv_state[:, untouched_slots].clone()
    active = torch.tensor([True, True, False])  # the third sequence finished: its state is not committed
    live_before = spec.ssm_state[:, SLOTS[2]].clone()
    model.ops.commit_state(spec.ssm_state, spec.conv_state, spec.ssm_stash(3, K), spec.conv_stash(3, K), slot_ids,
                           torch.full((3,), na), active)

    plain = prefilled(model, prompts)
    model.verify(rows[:, : na + 1], slot_ids, seq_lens, plain)
    assert_close("committed ssm", plain.ssm_state[:, SLOTS[:2]], spec.ssm_state[:, SLOTS[:2]])
    assert_close("committed conv", plain.conv_state[:, SLOTS[:2]], spec.conv_state[:, SLOTS[:2]])
    assert_unchanged("inactive sequence", live_before, spec.ssm_state[:, SLOTS[2]])
    assert_unchanged("other slots ssm", before[0], spec.ssm_state[:, untouched_slots])
    assert_unchanged("other slots conv", before[1], spec.conv_state[:, untouched_slots])


@torch.no_grad()
def test_mtp_cached_equals_nocache(model):
    """The drafter's path through the head's cache: a catch-up runs the attention half (mtp_prefill,
    mtp_attention), the MLP half runs at the last accepted row (mtp_mlp), drafts run whole rows (mtp_forward);
    each output equals the no-cache reference's row, and a catch-up writes the K/V rows the whole layer would."""
    T, one = 14, torch.tensor([1])
    ids = torch.randint(0, 67, (1, T + 1))
    h = model.hidden(ids[:, :T])  # (1, T, D)
    ref = model.mtp_hidden(ids[:, 1 : T + 1], h)[0]  # (T, D)
    kv, whole = mtp_kv(model.cfg, 3, 32), mtp_kv(model.cfg, 3, 32)
    r = model.mtp_prefill(ids[0, 1:9], h[0, :8], 1, *kv)  # (8, D)
    assert_close("mtp prefill, then the MLP half", ref[:8], model.mtp_mlp(r))
    r = model.mtp_attention(ids[:, 9:13], h[:, 8:12], one, one * 8, *kv)  # (1, 4, D)
    assert_close("mtp catch-up, then the MLP half at row 1 of 4", ref[9], model.mtp_mlp(r[0, 1]))
    model.mtp_forward(ids[:, 1:13], h[:, :12], one, one * 0, *whole)
    for a, b, name in zip(kv, whole, ("k", "v")):
        assert_close(f"mtp catch-up's {name} rows = the whole layer's", b[1, :12], a[1, :12])
    o = model.mtp_forward(ids[:, 13:15], h[:, 12:14], one, one * 12, *kv, kv_len=16)
    assert_close("mtp rows with kv_len bound", ref[12:14], o[0])
    assert_close("mtp logits", model.mtp_logits(ref[12:14]), model.mtp_logits(o[0]))


@torch.no_grad()
def test_reset_slot_forgets_previous_occupant(model):
    ids = torch.randint(0, 67, (2, 9))
    fresh = HybridCache(model.cfg, 2, 16, 3)
    used = HybridCache(model.cfg, 2, 16, 3)
    model.prefill(ids[0], 0, used)
    model.verify(ids[:1, :3], torch.tensor([0]), torch.tensor([9]), used)
    used.reset_slot(0)
    assert_unchanged("reset ssm", fresh.ssm_state, used.ssm_state)
    assert_unchanged("reset conv", fresh.conv_state, used.conv_state)
    a = model.logits(model.prefill(ids[1], 0, used))
    b = model.logits(model.prefill(ids[1], 0, fresh))
    assert_unchanged("prefill in reused slot", b, a)


def test_stash_view_too_large_is_refused(model):
    cache = HybridCache(model.cfg, 2, 16, 3)
    with pytest.raises(ValueError, match="exceeds the cache"):
        cache.ssm_stash(2, 4)
