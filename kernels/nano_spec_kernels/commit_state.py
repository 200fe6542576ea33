"""Commit the Mamba state to the accepted prefix, all layers and sequences at once.

After a verify over K rows each Mamba layer's live state is the one after row K-1; a sequence
that accepted na < K-1 drafts needs the one after row na instead:

    ssm_state[l, s]  <- ssm_stash[l, b, na]                  (H, P, N)
    conv_state[l, s] <- conv_stash[l, b, :, na+1 : na+W]     (C, W-1): the last W-1 inputs up to row na

Full accepts (na = K-1) and inactive rows are left untouched.

The Triton version is one launch, grid (L*B, tiles): program (l*B + b, t) copies tile t of the flat H*P*N
state and tile t of the flat C*(W-1) window of layer l, sequence b. na and active are read on the device and
fold into the masks, so a row that does not commit moves no bytes and the host never waits on the verdict.
"""
import torch

from nano_spec_kernels.common import INT, Arg, Checker, Launch, launch, tl, triton

_check = Checker("commit_state")
_ARGS = {
    "ssm_state": Arg("L S H P N"), "ssm_stash": Arg("L B K H P N", "ssm_state"),
    "conv_state": Arg("L S C Wm1"), "conv_stash": Arg("L B C Wm1+K", "conv_state"),
    "slot_ids, na": Arg("B", INT), "active": Arg("B", torch.bool),
}


def commit_state_ref(ssm_state, conv_state, ssm_stash, conv_stash, slot_ids, na, active):
    """ssm_state (L, S, H, P, N), conv_state (L, S, C, W-1), ssm_stash (L, B, K, H, P, N),
    conv_stash (L, B, C, W-1+K), slot_ids, na (B,) int, active (B,) bool. In place, only the rows
    that move: finding them (nonzero) waits for the device, which costs nothing on the CPU path."""
    K, Wm1 = ssm_stash.shape[2], conv_state.shape[-1]
    rows = (active & (na < K - 1)).nonzero()[:, 0]  # (R,) batch positions that rejected a draft
    if rows.numel() == 0:
        return
    slots, n = slot_ids[rows], na[rows]
    ssm_state[:, slots] = ssm_stash[:, rows, n]  # (L, R, H, P, N): the state after row na
    cols = n[:, None] + 1 + torch.arange(Wm1, device=na.device)  # (R, W-1): the window after row na
    idx = cols[None, :, None, :].expand(conv_stash.shape[0], -1, conv_stash.shape[2], -1)
    conv_state[:, slots] = conv_stash[:, rows].gather(-1, idx)


@triton.jit
def _commit_state_kernel(p_ssm_state, p_conv_state, p_ssm_stash, p_conv_stash, p_slot, p_na, p_active,
                         Bsz, S, K, HPN, C,
                         Wm1: tl.constexpr, BLOCK: tl.constexpr):
    i_lb, i_t = tl.program_id(0), tl.program_id(1)
    i_l, i_b = i_lb // Bsz, i_lb % Bsz
    i_s = tl.load(p_slot + i_b).to(tl.int64)
    b_na = tl.load(p_na + i_b).to(tl.int32)
    b_take = (tl.load(p_active + i_b) != 0) & (b_na < K - 1)
    b_na = tl.minimum(tl.maximum(b_na, 0), K - 1)  # the reference indexes with na clamped to [0, K-1]
    o = i_t * BLOCK + tl.arange(0, BLOCK)
    # take as a vector compare (the interpreter mis-types block mask & scalar bool)
    m_take = (o * 0 + b_take.to(tl.int32)) != 0

    # ssm: (H*P*N,) contiguous row na of the stash -> live state of slot s
    m = (o < HPN) & m_take
    src = p_ssm_stash + ((i_l * Bsz + i_b).to(tl.int64) * K + b_na) * HPN
    dst = p_ssm_state + (i_l.to(tl.int64) * S + i_s) * HPN
    tl.store(dst + o, tl.load(src + o, mask=m), mask=m)

    # conv: flat index o = c*(W-1) + w reads conv_stash[l, b, c, na + 1 + w]
    m = (o < C * Wm1) & m_take
    o_c, o_w = o // Wm1, o % Wm1
    src = p_conv_stash + (i_l * Bsz + i_b).to(tl.int64) * C * (Wm1 + K)
    dst = p_conv_state + (i_l.to(tl.int64) * S + i_s) * C * Wm1
    tl.store(dst + o, tl.load(src + o_c * (Wm1 + K) + b_na + 1 + o_w, mask=m), mask=m)


def commit_state_plan(ssm_state, conv_state, ssm_stash, conv_stash, slot_ids, na, active, *, cuda: bool, n_sm: int):
    d = _check.args(_ARGS, ssm_state=ssm_state, conv_state=conv_state, ssm_stash=ssm_stash, conv_stash=conv_stash,
                    slot_ids=slot_ids, na=na, active=active)
    L, S, Bsz, K, C, Wm1 = d.L, d.S, d.B, d.K, d.C, d.Wm1
    _check(Wm1 >= 1, "conv window W-1 must be >= 1")
    if L * Bsz == 0:
        return [], None
    HPN = d.H * d.P * d.N
    BLOCK = 1024
    grid = (L * Bsz, triton.cdiv(max(HPN, C * Wm1), BLOCK))
    args = (ssm_state, conv_state, ssm_stash, conv_stash, slot_ids, na, active.view(torch.uint8), Bsz, S, K, HPN, C)
    return [Launch(_commit_state_kernel, grid, args, dict(Wm1=Wm1, BLOCK=BLOCK, num_warps=4))], None


def commit_state(ssm_state, conv_state, ssm_stash, conv_stash, slot_ids, na, active):
    """Triton version of commit_state_ref (same arguments, in place, no host sync): all tensors
    contiguous on one device, each state with its stash's dtype."""
    launch(commit_state_plan, ssm_state, conv_state, ssm_stash, conv_stash, slot_ids, na, active)


def commit_state_bytes(L: int, B: int, K: int, H: int, P: int, N: int, C: int, W: int, act: int,
                       rows: int | None = None) -> dict:
    """The bytes one call moves, by tensor, when `rows` of the B sequences commit (all of them when None; a row
    that does not commit moves nothing): per Mamba layer and committing row, one stash state read and one live
    state written, ssm (fp32) and conv window (act bytes an element); slot_ids, na (int64) and active read once."""
    rows = B if rows is None else rows
    return {"slot_ids, na, active": B * (8 + 8 + 1),
            "ssm_stash read": L * rows * H * P * N * 4, "ssm_state written": L * rows * H * P * N * 4,
            "conv_stash read": L * rows * C * (W - 1) * act, "conv_state written": L * rows * C * (W - 1) * act}
