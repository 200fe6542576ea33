"""Verdict kernels (and gather_rows) vs their references and plain python loops.

Greedy: picks / na must be identical to torch and to a python loop (ties go to the
first index). Sampled: with fixed uniforms (na, token) must
equal the reference exactly; with random uniforms the emitted tokens must follow
the target distribution (a chi-square test with a fixed seed).
"""
import inspect

import pytest
import torch

from nano_spec_kernels.common import launch
from nano_spec_kernels.gather_rows import gather_rows, gather_rows_ref
from nano_spec_kernels.verdict_greedy import verdict_greedy, verdict_greedy_plan, verdict_greedy_ref
from nano_spec_kernels.verdict_sample import sampling_probs_ref, verdict_sample, verdict_sample_plan, verdict_sample_ref
from helpers import assert_close, assert_refuses, assert_unchanged

ERRS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _print_errors():
    yield
    print("\nmax abs err vs reference: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(ERRS.items())))


# ---------------------------------------------------------------- gather_rows

@pytest.mark.parametrize("Bsz, K, D", [(3, 5, 300), (1, 1, 7), (4, 2, 2049)], ids=lambda x: str(x))
def test_gather_rows_matches_reference(device, Bsz, K, D):
    src = torch.randn(Bsz, K, D + 3, device=device)[..., :D]  # a strided view
    idx = torch.randint(0, K, (Bsz,), device=device)
    src0 = src.clone()
    out = gather_rows(src, idx)
    assert_unchanged("gather_rows vs reference", gather_rows_ref(src, idx), out)  # a copy: exact
    assert_unchanged("src", src0, src)
    ERRS["gather_rows"] = 0.0


def test_gather_rows_rejects_bad_shapes(device):
    with torch.device(device):  # the tensors made below live on the device under test, as the engine's do
        src = torch.randn(3, 4, 8, device=device)
        with pytest.raises(ValueError, match="gather_rows: src"):
            gather_rows(src[0], torch.zeros(3, dtype=torch.long))
        with pytest.raises(ValueError, match="gather_rows: idx"):
            gather_rows(src, torch.zeros(2, dtype=torch.long))
        with pytest.raises(ValueError, match="gather_rows: idx"):
            gather_rows(src, torch.zeros(3))
        with pytest.raises(ValueError, match="gather_rows: idx must be contiguous"):  # the kernel reads idx[b] at b
            gather_rows(src, torch.zeros(3, 2, dtype=torch.long, device=device)[:, 0])
        with pytest.raises(ValueError, match="gather_rows: src must have a unit stride"):
            gather_rows(src.transpose(1, 2), torch.zeros(3, dtype=torch.long, device=device))


# ---------------------------------------------------------------- verdict_greedy

def _greedy_loop(logits, drafts, nd):
    """The greedy verdict as plain python: first maximal index, then count leading matches."""
    Bsz, K, V = logits.shape
    rows = logits.float().tolist()
    picks = [[max(range(V), key=lambda i, r=r: (r[i], -i)) for r in seq] for seq in rows]
    na = []
    for b in range(Bsz):
        n = 0
        while n < int(nd[b]) and n < K - 1 and int(drafts[b, n]) == picks[b][n]:
            n += 1
        na.append(n)
    return torch.tensor(picks, dtype=torch.long), torch.tensor(na, dtype=torch.long)


def _check_greedy(logits, drafts, nd, block_v=None, splits=None):
    picks, na = launch(verdict_greedy_plan, logits, drafts, nd, block_v=block_v, num_splits=splits)
    r_picks, r_na = verdict_greedy_ref(logits, drafts, nd)
    l_picks, l_na = _greedy_loop(logits, drafts, nd)
    assert_unchanged("picks vs reference", r_picks, picks)
    assert_unchanged("picks vs python loop", l_picks.to(picks.device), picks)
    assert_unchanged("na vs reference", r_na, na)
    assert_unchanged("na vs python loop", l_na.to(na.device), na)
    assert picks.dtype == na.dtype == torch.int64
    ERRS["verdict_greedy (picks, na) mismatches"] = 0.0
    return picks, na


GREEDY_CASES = [
    # B, K, V, block_v, num_splits (None = the launcher's choice)
    pytest.param(4, 1, 1000, None, None, id="B4-K1-V1000"),
    pytest.param(5, 3, 1000, 128, 3, id="B5-K3-V1000-blk128-3splits"),
    pytest.param(6, 5, 777, 64, None, id="B6-K5-V777-blk64"),
    pytest.param(3, 2, 4099, 256, 4, id="B3-K2-V4099-blk256-4splits"),
]


@pytest.mark.parametrize("Bsz, K, V, block_v, splits", GREEDY_CASES)
def test_verdict_greedy_random(device, Bsz, K, V, block_v, splits):
    logits = 3 * torch.randn(Bsz, K, V, device=device)
    picks = logits.argmax(-1)
    # drafts that mostly match, with one wrong draft per sequence at a random row
    drafts = picks[:, : K - 1].clone()
    if K > 1:
        wrong = torch.randint(0, K - 1, (Bsz,), device=device)
        drafts[torch.arange(Bsz), wrong] = (drafts[torch.arange(Bsz), wrong] + 1) % V
    nd = torch.randint(0, K, (Bsz,), device=device)
    _check_greedy(logits, drafts, nd, block_v, splits)


@pytest.mark.parametrize("block_v, splits", [(None, None), (64, 3), (32, 1)], ids=["default", "blk64-3splits", "blk32-1split"])
def test_verdict_greedy_adversarial(device, block_v, splits):
    """Ties inside and across tiles/splits, -inf tiles, all accepted, first rejected, nd < K-1."""
    Bsz, K, V = 6, 4, 300
    logits = torch.randn(Bsz, K, V, device=device)
    logits[0, :, [5, 70, 299]] = 9.0  # tie across tiles: first index 5
    logits[1, :, [64, 65, 250]] = 9.0  # tie at a tile start
    logits[2, 0, :] = 1.0  # every entry tied: argmax 0
    logits[2, 1, :128] = float("-inf")  # masked vocabulary spanning whole tiles
    logits[3, 2, 298:] = 50.0  # max in the last, partial tile
    picks = logits.argmax(-1)
    drafts = picks[:, : K - 1].clone()
    nd = torch.full((Bsz,), K - 1, device=device)
    # row 0: all accepted; row 1: first rejected; row 2: nd = 1 < K-1 with all matching
    drafts[1, 0] = (picks[1, 0] + 1) % V
    nd[2] = 1
    # row 3: mismatch in the middle; row 4: nd = 0; row 5: rejected then matching again
    drafts[3, 1] = (picks[3, 1] + 7) % V
    nd[4] = 0
    drafts[5, 0] = (picks[5, 0] + 1) % V
    got_picks, got_na = _check_greedy(logits, drafts, nd, block_v, splits)
    assert got_picks[0, 0] == 5 and got_picks[1, 0] == 64 and got_picks[2, 0] == 0
    assert got_na.tolist() == [K - 1, 0, 1, 1, 0, 0]


def test_verdict_greedy_large_vocab(device):
    """V = 100k+ with the launcher's tiling: one sequence, K = 2."""
    V = 131072 + 5
    logits = torch.randn(1, 2, V, device=device)
    logits[0, 1, V - 1] = 10.0
    drafts = logits.argmax(-1)[:, :1]
    _, na = _check_greedy(logits, drafts, torch.tensor([1], device=device))
    assert na.item() == 1


def _random_bitmask(Bsz, K, V, device, p_allowed=0.3, seed=0):
    """A packed (B, K, ceil(V/32)) int32 mask with bits past V clear, and the bool (B, K, V) it encodes."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(Bsz, K, V, generator=gen) < p_allowed
    allowed[..., int(torch.randint(V, (), generator=gen))] = True  # never an empty row
    Vw = (V + 31) // 32
    bits = torch.zeros(Bsz, K, Vw * 32, dtype=torch.int64)
    bits[..., :V] = allowed.long()
    words = (bits.view(Bsz, K, Vw, 32) << torch.arange(32)).sum(-1)  # (B, K, Vw) as unsigned 32-bit values
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.to(device), allowed.to(device)


@pytest.mark.parametrize("Bsz, K, V, block_v, splits",
                         [(3, 4, 77, 32, None), (2, 3, 1000, 128, 3), (4, 2, 4099, 256, 4)],
                         ids=["B3-K4-V77-blk32", "B2-K3-V1000-blk128-3splits", "B4-K2-V4099-blk256-4splits"])
def test_verdict_greedy_bitmask(device, Bsz, K, V, block_v, splits):
    """The masked argmax over the allowed tokens; rows with an all-ones mask equal the unmasked verdict bit
    for bit; the logits are not written."""
    logits = 3 * torch.randn(Bsz, K, V, device=device)
    bitmask, allowed = _random_bitmask(Bsz, K, V, device)
    bitmask[0, 1:] = -1  # rows of sequence 0 past its first: no constraint (every bit set)
    allowed[0, 1:] = True
    want = logits.masked_fill(~allowed, float("-inf")).argmax(-1)  # (B, K)
    drafts = want[:, : K - 1].clone()
    drafts[-1, 0] = (drafts[-1, 0] + 1) % V  # last sequence: its first draft is rejected
    nd = torch.full((Bsz,), K - 1, device=device)
    before = logits.clone()
    picks, na = launch(verdict_greedy_plan, logits, drafts, nd, bitmask, block_v=block_v, num_splits=splits)
    r_picks, r_na = verdict_greedy_ref(logits, drafts, nd, bitmask)
    assert_unchanged("logits", before, logits)
    assert_unchanged("masked picks vs reference", r_picks, picks)
    assert_unchanged("masked picks vs masked argmax", want, picks)
    assert_unchanged("masked na vs reference", r_na, na)
    assert na.tolist() == [K - 1] * (Bsz - 1) + [0]
    assert bool(allowed.gather(-1, picks[..., None]).all()), "a pick outside the mask"
    plain_picks, _ = launch(verdict_greedy_plan, logits, drafts, nd, block_v=block_v, num_splits=splits)
    assert_unchanged("unmasked rows (all bits set)", plain_picks[0, 1:], picks[0, 1:])
    # a mask that allows everything is no mask at all, in the kernel and the reference
    ones = torch.full_like(bitmask, -1)
    assert_unchanged("all-ones mask", plain_picks, launch(verdict_greedy_plan, logits, drafts, nd, ones,
                                                          block_v=block_v, num_splits=splits)[0])
    assert_unchanged("all-ones mask (reference)", verdict_greedy_ref(logits, drafts, nd)[0],
                     verdict_greedy_ref(logits, drafts, nd, ones)[0])


def test_verdict_greedy_bitmask_rejects_bad_masks(device):
    logits = torch.randn(2, 3, 50, device=device)
    drafts, nd = torch.zeros(2, 2, dtype=torch.long, device=device), torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=r"verdict_greedy: bitmask must be int32 \(2, 3, 2\)"):
        verdict_greedy(logits, drafts, nd, torch.zeros(2, 3, 1, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="verdict_greedy: bitmask must be int32"):
        verdict_greedy(logits, drafts, nd, torch.zeros(2, 3, 2, dtype=torch.int64, device=device))


@pytest.mark.parametrize("launcher, ref, names", [
    (verdict_greedy, verdict_greedy_ref, ["logits", "drafts", "nd", "bitmask"]),
    (verdict_sample, verdict_sample_ref, ["logits", "draft_probs", "drafts", "nd", "uniforms", "temperature", "top_k",
                                          "top_p", "filtered"]),
], ids=["greedy", "sample"])
def test_verdict_signatures(launcher, ref, names):
    """Launcher and reference take the same arguments in the same order (nano_spec passes them positionally)."""
    assert list(inspect.signature(launcher).parameters) == list(inspect.signature(ref).parameters) == names


def test_verdict_greedy_rejects_bad_shapes(device):
    with torch.device(device):  # the tensors made below live on the device under test, as the engine's do
        logits = torch.randn(2, 3, 50, device=device)
        with pytest.raises(ValueError, match="verdict_greedy: drafts"):
            verdict_greedy(logits, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
        with pytest.raises(ValueError, match="verdict_greedy: nd"):
            verdict_greedy(logits, torch.zeros(2, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long))
        with pytest.raises(ValueError, match="verdict_greedy: nd must be contiguous"):
            verdict_greedy(logits, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long)[:, 0])
        with pytest.raises(ValueError, match="verdict_greedy: logits"):
            verdict_greedy(logits[0], torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, dtype=torch.long))


# ---------------------------------------------------------------- verdict_sample

def _sample_inputs(Bsz, K, V, device, draft_noise=0.5):
    """Target logits, per-sequence sampling settings, draft probs close to p (so some drafts are
    accepted), drafts sampled from them, random nd and uniforms."""
    logits = 2 * torch.randn(Bsz, K, V, device=device)
    temperature = 0.5 + torch.rand(Bsz, device=device)
    top_k = torch.tensor([0, 1, 5, V // 2] * Bsz, device=device)[:Bsz]
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.8] * Bsz, device=device)[:Bsz]
    q_logits = logits[:, : K - 1] + draft_noise * torch.randn(Bsz, K - 1, V, device=device)
    draft_probs = sampling_probs_ref(q_logits, temperature, top_k, top_p)
    if K > 1:
        drafts = torch.multinomial(draft_probs.reshape(-1, V), 1).reshape(Bsz, K - 1)
    else:
        drafts = torch.zeros(Bsz, 0, dtype=torch.long, device=device)
    nd = torch.randint(0, K, (Bsz,), device=device)
    uniforms = torch.rand(Bsz, K, device=device)
    return logits, draft_probs, drafts, nd, uniforms, temperature, top_k, top_p


SAMPLE_CASES = [
    pytest.param(6, 1, 100, None, id="B6-K1-V100"),
    pytest.param(8, 3, 300, 64, id="B8-K3-V300-blk64"),
    pytest.param(10, 5, 777, 128, id="B10-K5-V777-blk128"),
    pytest.param(16, 2, 6, None, id="B16-K2-V6"),
    pytest.param(4, 4, 2500, 512, id="B4-K4-V2500-blk512"),
]


@pytest.mark.parametrize("Bsz, K, V, block_v", SAMPLE_CASES)
def test_verdict_sample_matches_reference(device, Bsz, K, V, block_v):
    """Exact equality with fixed uniforms. The only rounding difference is the order of the cdf
    sums (a few ulp); a token could differ only if u * total fell within that distance of a cdf
    value, which for random fp32 uniforms has probability ~1e-6 per draw, and the seed is fixed."""
    args = _sample_inputs(Bsz, K, V, device)
    args[4][0, K - 1] = 0.0  # u = 0: the first token with mass
    na, token = launch(verdict_sample_plan, *args, block_v=block_v)
    r_na, r_token = verdict_sample_ref(*args)
    assert_unchanged("na", r_na, na)
    assert_unchanged("token", r_token, token)
    ERRS["verdict_sample (na, token) mismatches"] = 0.0


@pytest.mark.parametrize("mate", ["top_k", "top_p"])
def test_an_unfiltered_row_is_the_softmax_whatever_its_batch(device, mate):
    """A row without top-k or top-p gets the softmax at its temperature, bit for bit the same whether the batch
    runs the sort (filtered: a batch-mate filters) or not; the mate's row is filtered (reference.filtered)."""
    from nano_spec.reference import filtered

    logits = 3 * torch.randn(3, 2, 37, device=device)
    temperature = torch.tensor([0.7, 1.3, 1.1], device=device)
    top_k = torch.tensor([0, 0, 5 if mate == "top_k" else 0], device=device)
    top_p = torch.tensor([1.0, 1.0, 0.6 if mate == "top_p" else 1.0], device=device)
    alone = sampling_probs_ref(logits[:2], temperature[:2], top_k[:2], top_p[:2], filtered=False)
    mixed = sampling_probs_ref(logits, temperature, top_k, top_p, filtered=True)
    assert_unchanged("unfiltered rows, sorted batch vs not", alone, mixed[:2])
    assert_close("unfiltered rows vs softmax", torch.softmax(logits[:2].double() / temperature[:2, None, None], -1),
                 alone, atol=1e-6)
    for r in range(2):  # the filtering row: the reference's per-row filter
        assert_close(f"filtered row {r}", filtered(logits[2, r], 1.1, int(top_k[2]), float(top_p[2])), mixed[2, r],
                     atol=1e-6)
    assert (mixed[2] > 0).sum() < mixed[2].numel()  # it did filter


def test_verdict_sample_unfiltered_skips_the_sort(device):
    """filtered=False on a batch where no row filters gives what the sorting path gives (launcher vs reference)."""
    args = list(_sample_inputs(6, 3, 300, device))
    args[6], args[7] = torch.zeros_like(args[6]), torch.ones_like(args[7])  # top_k off, top_p off
    na, token = verdict_sample(*args, filtered=False)
    r_na, r_token = verdict_sample_ref(*args, filtered=True)
    assert_unchanged("na", r_na, na)
    assert_unchanged("token", r_token, token)


def test_verdict_sample_adversarial(device):
    """All accepted (q = p), a draft outside the top-k (p = q = 0 there: rejected, empty residual,
    fallback to p), nd < K-1, and rejections at every row."""
    Bsz, K, V = 8, 4, 40
    logits, q, drafts, nd, u, temp, top_k, top_p = _sample_inputs(Bsz, K, V, device)
    p = sampling_probs_ref(logits, temp, top_k, top_p)
    q[0] = p[0, : K - 1]  # q = p: u * p < p always, full accept, bonus from p[K-1]
    drafts[0] = p[0, : K - 1].argmax(-1)
    nd[0] = K - 1
    q[1] = p[1, : K - 1]  # draft with p = q = 0 (top_k = 1 keeps one token)
    drafts[1, 0] = (p[1, 0].argmax() + 1) % V
    nd[1] = K - 1
    nd[2] = 1  # fewer valid drafts than K-1
    u[3, : K - 1] = 0.999999  # rejections wherever q > p at the draft
    na, token = verdict_sample(logits, q, drafts, nd, u, temp, top_k, top_p)
    r_na, r_token = verdict_sample_ref(logits, q, drafts, nd, u, temp, top_k, top_p)
    assert_unchanged("na", r_na, na)
    assert_unchanged("token", r_token, token)
    assert na[0] == K - 1 and na[1] == 0 and na[2] <= 1
    assert p[1, 0, token[1]] > 0  # the fallback draws from p, never a zero-mass token


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of counts to probs over the support of probs (zero-mass tokens
    must have zero counts: checked by the caller)."""
    n = counts.sum()
    keep = probs > 0
    exp = n * probs[keep].double()
    stat = ((counts[keep].double() - exp) ** 2 / exp).sum()
    df = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


def test_verdict_sample_is_lossless(device):
    """Many sequences with the same target rows p_0..p_2 (V = 6, temperature 0.8, top-k 5, so one
    token has no mass) and a different draft q; drafts ~ q, random uniforms. Emitted tokens are
    drafts[:na] + [token]; the j-th emitted token (among sequences that emit one at j) must be
    distributed as p_j. chi-square p-value > 1e-4 with a fixed seed (deterministic, not flaky);
    the same counts must reject the draft distribution q and the wrong rule "after a rejection
    sample from p instead of the residual" (p-value < 1e-9), which shows the test has power."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    Bsz, K, V = 30000, 3, 6
    t_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 2.5, 0.3, 1.0, 0.2, -0.5], [1.0, 1.0, -2.0, 0.5, 3.0, 0.0]])
    q_rows = torch.tensor([[0.05, 0.4, 0.05, 0.3, 0.1, 0.1], [0.3, 0.1, 0.3, 0.1, 0.1, 0.1]])
    temperature = torch.full((Bsz,), 0.8, device=device)
    top_k = torch.full((Bsz,), 5, device=device, dtype=torch.long)
    top_p = torch.ones(Bsz, device=device)
    logits = t_logits.to(device).expand(Bsz, K, V).contiguous()
    q = q_rows.to(device).expand(Bsz, K - 1, V).contiguous()
    drafts = torch.stack([torch.multinomial(q_rows[j], Bsz, replacement=True, generator=gen) for j in range(K - 1)], 1).to(device)
    nd = torch.full((Bsz,), K - 1, device=device)
    uniforms = torch.rand(Bsz, K, generator=gen).to(device)

    na, token = verdict_sample(logits, q, drafts, nd, uniforms, temperature, top_k, top_p)
    p = sampling_probs_ref(t_logits[None].to(device), temperature[:1], top_k[:1], top_p[:1])[0]  # (K, V)
    emitted = torch.cat([drafts, torch.full((Bsz, 1), -1, device=device)], 1)
    emitted[torch.arange(Bsz, device=device), na] = token  # emitted[b, :na+1] are the step's tokens
    for j in range(K):
        rows = na >= j
        counts = torch.bincount(emitted[rows, j], minlength=V).cpu()
        assert counts[p[j].cpu() == 0].sum() == 0, f"row {j}: a zero-probability token was emitted"
        pval = _chi2_pvalue(counts, p[j].cpu())
        assert pval > 1e-4, f"row {j}: emitted distribution differs from p (chi-square p-value {pval:.2e}), counts {counts.tolist()}"
    counts0 = torch.bincount(emitted[:, 0], minlength=V).cpu().double()
    q0, p0 = q_rows[0].double(), p[0].cpu().double()
    assert _chi2_pvalue(counts0, q0) < 1e-9, "the test cannot tell p from q"
    wrong = torch.minimum(p0, q0) + (1 - torch.minimum(p0, q0).sum()) * p0
    assert _chi2_pvalue(counts0, wrong) < 1e-9, "the test cannot tell the residual rule from resampling p"


def test_verdict_sample_rejects_bad_shapes(device):
    Bsz, K, V = 2, 3, 10
    logits, q, drafts, nd, u, temp, top_k, top_p = _sample_inputs(Bsz, K, V, device)
    with pytest.raises(ValueError, match="verdict_sample: draft_probs"):
        verdict_sample(logits, q[:, :1], drafts, nd, u, temp, top_k, top_p)
    with pytest.raises(ValueError, match="verdict_sample: logits must be floating point"):
        verdict_sample(logits.long(), q, drafts, nd, u, temp, top_k, top_p)
    with pytest.raises(ValueError, match="drafts"):
        verdict_sample(logits, q, drafts.float(), nd, u, temp, top_k, top_p)
    with pytest.raises(ValueError, match="uniforms"):
        verdict_sample(logits, q, drafts, nd, u[:, :2], temp, top_k, top_p)
    with pytest.raises(ValueError, match="uniforms"):
        verdict_sample(logits, q, drafts, nd, u.half(), temp, top_k, top_p)
    with pytest.raises(ValueError, match="top_p"):
        verdict_sample(logits, q, drafts, nd, u, temp, top_k, top_p[:1])


# ---------------------------------------------------------------- launcher checks

SAMPLE_ARGS = ("logits", "draft_probs", "drafts", "nd", "uniforms", "temperature", "top_k", "top_p")
LAUNCHERS = {  # launcher, valid keyword arguments on a device
    "gather_rows": (gather_rows, lambda d: dict(src=torch.randn(3, 4, 8, device=d),
                                                idx=torch.zeros(3, dtype=torch.long, device=d))),
    "verdict_greedy": (verdict_greedy, lambda d: dict(
        logits=torch.randn(2, 3, 40, device=d), drafts=torch.zeros(2, 2, dtype=torch.long, device=d),
        nd=torch.zeros(2, dtype=torch.long, device=d), bitmask=torch.zeros(2, 3, 2, dtype=torch.int32, device=d))),
    "verdict_sample": (verdict_sample, lambda d: dict(zip(SAMPLE_ARGS, _sample_inputs(2, 3, 40, d)))),
}
REFUSALS = [  # launcher, argument, fault
    ("gather_rows", "idx", "shape"), ("gather_rows", "idx", "dtype"), ("gather_rows", "idx", "noncontig"),
    ("gather_rows", "src", "stride"), ("gather_rows", "idx", "device"),
    ("verdict_greedy", "drafts", "shape"), ("verdict_greedy", "logits", "dtype"),
    ("verdict_greedy", "nd", "noncontig"), ("verdict_greedy", "bitmask", "stride"),
    ("verdict_greedy", "nd", "device"),
    ("verdict_sample", "uniforms", "shape"), ("verdict_sample", "draft_probs", "dtype"),
    ("verdict_sample", "nd", "noncontig"), ("verdict_sample", "draft_probs", "stride"),
    ("verdict_sample", "top_k", "device"),
]


@pytest.mark.parametrize("kernel, arg, fault", REFUSALS, ids=["-".join(c) for c in REFUSALS])
def test_launchers_name_the_bad_argument(device, kernel, arg, fault):
    """One argument wrong in one way: a ValueError naming the kernel, the argument and what is wrong."""
    launcher, inputs = LAUNCHERS[kernel]
    assert_refuses(kernel, launcher, inputs(device), arg, fault)
