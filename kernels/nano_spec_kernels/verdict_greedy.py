"""Greedy verdict in one pass over the logits.

For logits (B, K, V): picks[b, j] = argmax (the first maximal index on ties) and na[b] = the number of leading
drafts equal to the pick of their row, clamped to nd[b] (the valid drafts; the rest of the (B, K-1)
drafts are padding). An optional grammar bitmask (B, K, Vw = ceil(V / 32)) int32 restricts row (b, j) to the
tokens whose bit is set (bit t % 32 of word t // 32, llguidance's packing): the others count as -inf inside
the pass, and the logits are never written.

One read of the logits: `_row_stats_kernel` walks one of the SPLITS chunks of a row keeping a running max and
its first index; `_verdict_kernel` (one program per sequence) merges the partials of its K rows and counts the
leading drafts that match. Ties keep the first index in both. Splitting V gives even one sequence enough
programs for the device when V is 100k+; the split count depends on shapes only.
"""
import torch

from nano_spec_kernels.common import FLOAT, INT, ROW, STRIDED, Arg, Checker, Launch, launch, split_plan, tl, triton

_check = Checker("verdict_greedy")
_ARGS = {"logits": Arg("B K V", FLOAT, ROW), "drafts": Arg("B K-1", INT, STRIDED), "nd": Arg("B", INT)}
_MASK = {"bitmask": Arg("B K Vw", torch.int32, ROW)}  # Vw = ceil(V / 32) words, bound by the launcher


def verdict_greedy_ref(logits, drafts, nd, bitmask=None):
    """logits (B, K, V), drafts (B, K-1) int64, nd (B,) int64, bitmask (B, K, Vw) int32 or None ->
    (picks (B, K) int64, na (B,) int64)."""
    lf = logits.float()
    if bitmask is not None:
        lf = lf.masked_fill(~unpack_bitmask(bitmask, lf.shape[-1]), float("-inf"))
    picks = lf.argmax(-1)  # (B, K)
    K = logits.shape[1]
    match = (drafts == picks[:, : K - 1]) & (torch.arange(K - 1, device=logits.device) < nd[:, None])
    na = match.long().cumprod(-1).sum(-1)
    return picks, na


@triton.jit
def _row_stats_kernel(
    p_logits, p_mask, p_pm, p_pa, V, CHUNK, s_l_b, s_l_k, s_m_b, s_m_k,
    K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """grid (B * K, SPLITS): partial (max, first argmax) of one chunk of one row."""
    i_row, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_j = i_row // K, i_row % K
    p_row = p_logits + i_b.to(tl.int64) * s_l_b + i_j * s_l_k
    p_mrow = p_mask + i_b.to(tl.int64) * s_m_b + i_j * s_m_k
    lo = i_s * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    o_v = tl.arange(0, BLOCK_V)
    b_max = float("-inf")
    b_arg = lo
    for start in range(lo, hi, BLOCK_V):
        o_x = start + o_v
        b_x = tl.load(p_row + o_x, mask=o_x < hi, other=float("-inf")).to(tl.float32)  # (BLOCK_V,)
        if HAS_MASK:  # a disallowed token is -inf here only; the logits stay as they are
            b_w = tl.load(p_mrow + o_x // 32, mask=o_x < hi, other=0)  # the word holding each token's bit
            b_x = tl.where(((b_w >> (o_x % 32)) & 1) != 0, b_x, float("-inf"))
        b_bmax = tl.max(b_x, 0)
        b_barg = tl.min(tl.where(b_x == b_bmax, o_x, V), 0)  # first maximal index of the block
        b_arg = tl.where(b_bmax > b_max, b_barg, b_arg)
        b_max = tl.maximum(b_max, b_bmax)
    tl.store(p_pm + i_row * SPLITS + i_s, b_max)
    tl.store(p_pa + i_row * SPLITS + i_s, b_arg)


@triton.jit
def _verdict_kernel(
    p_pm, p_pa, p_drafts, p_nd, p_picks, p_na, V, s_d_b, s_d_k,
    K: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """grid (B,): merge the partials of the K rows of sequence b; picks and na."""
    i_b = tl.program_id(0)
    nd = tl.load(p_nd + i_b)
    o_s = tl.arange(0, SPLITS_PAD)
    m_s = o_s < SPLITS
    b_alive = nd >= 0  # True: every draft so far matched
    b_na = nd * 0
    for j in tl.static_range(K):
        o_p = (i_b * K + j) * SPLITS + o_s
        b_m = tl.load(p_pm + o_p, mask=m_s, other=float("-inf"))  # (SPLITS_PAD,)
        b_a = tl.load(p_pa + o_p, mask=m_s, other=V)
        b_max = tl.max(b_m, 0)
        b_pick = tl.min(tl.where(b_m == b_max, b_a, V), 0)  # splits are in V order: smallest index wins a tie
        tl.store(p_picks + i_b * K + j, b_pick.to(tl.int64))
        if j < K - 1:
            b_d = tl.load(p_drafts + i_b * s_d_b + j * s_d_k)
            b_alive = b_alive & (b_d == b_pick) & (j < nd)
            b_na += b_alive.to(nd.dtype)
    tl.store(p_na + i_b, b_na.to(tl.int64))


def row_stats_meta(V: int, cuda: bool, block_v: int | None = None) -> dict:
    """_row_stats_kernel's meta-parameters (scripts/compile_check.py compiles these); block_v overrides the tile."""
    return dict(BLOCK_V=block_v or min(2048 if cuda else 1024, triton.next_power_of_2(V)), num_warps=4)


def verdict_greedy_plan(logits, drafts, nd, bitmask=None, block_v=None, num_splits=None, *, cuda: bool, n_sm: int):
    """block_v and num_splits override the tile and split sizes (tests force several of each)."""
    dims = _check.args(_ARGS, logits=logits, drafts=drafts, nd=nd)
    Bsz, K, V, dev = dims.B, dims.K, dims.V, dims.device
    _check(K >= 1 and V >= 1, f"logits needs K >= 1 and V >= 1, got {tuple(logits.shape)}")
    dims.Vw = (V + 31) // 32
    _check.args(_MASK, dims, bitmask=bitmask)
    picks = torch.empty((Bsz, K), dtype=torch.int64, device=dev)
    na = torch.empty((Bsz,), dtype=torch.int64, device=dev)
    if Bsz == 0:
        return [], (picks, na)

    meta = row_stats_meta(V, cuda, block_v)
    chunk, splits = split_plan(V, meta["BLOCK_V"], Bsz * K, n_sm, num_splits)
    pm = torch.empty((Bsz * K, splits), dtype=torch.float32, device=dev)  # partial maxima
    pa = torch.empty((Bsz * K, splits), dtype=torch.int32, device=dev)  # their first indices
    m = logits if bitmask is None else bitmask  # never read without a mask
    d = drafts if K > 1 else picks  # never read when K = 1
    return [
        Launch(_row_stats_kernel, (Bsz * K, splits),
               (logits, m, pm, pa, V, chunk, *logits.stride()[:2], *m.stride()[:2]),
               dict(K=K, SPLITS=splits, HAS_MASK=bitmask is not None, **meta)),
        Launch(_verdict_kernel, (Bsz,), (pm, pa, d, nd, picks, na, V, *d.stride()),
               dict(K=K, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), num_warps=4)),
    ], (picks, na)


def verdict_greedy(logits, drafts, nd, bitmask=None):
    """Triton version of verdict_greedy_ref (same signature and outputs). NaN logits are not
    handled (torch.argmax would pick them)."""
    return launch(verdict_greedy_plan, logits, drafts, nd, bitmask)


def verdict_greedy_bytes(B: int, K: int, V: int, act: int, splits: int, mask: bool = False) -> dict:
    """The bytes one call moves, by tensor: the logits (act bytes an element) and the grammar's bitmask read once,
    the (max, index) partials of the splits written and read back, drafts, nd, picks and na (int64)."""
    return {"logits": B * K * V * act, "bitmask": B * K * ((V + 31) // 32) * 4 if mask else 0,
            "partials written": B * K * splits * 8, "partials read": B * K * splits * 8,
            "drafts, nd": B * (K - 1) * 8 + B * 8, "picks, na": B * K * 8 + B * 8}


def unpack_bitmask(bitmask, V: int):
    """bitmask (..., Vw) int32, bit t % 32 of word t // 32 -> allowed (..., V) bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[..., None] >> shifts) & 1).flatten(-2)[..., :V].bool()
