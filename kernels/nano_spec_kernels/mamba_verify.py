"""Mamba2 multi-row verify: K rows for each of B sequences, addressed by slot.

Per sequence b (slot s = slot_ids[b]), rows j = 0..K-1:
  1. window = [conv_state[s] | xBC[b, 0..K-1]]          (C, W-1+K)  -> conv_stash[b]
  2. xbc_j = silu(conv1d(window[:, j .. j+W-1]) + bias); split into x, B_g, C_g
  3. dt_j = clamp(softplus(dt[b, j] + dt_bias), dt_limit)
  4. S = exp(dt_j A) S + dt_j x_j B_j^T -> ssm_stash[b, j];  y[b, j] = S C_j + D x_j
  5. live state: ssm_state[s] = S after row K-1, conv_state[s] = window[:, K:]
K = 1 is the plain decode step.

The Triton version is two launches:

  _mamba_verify_kernel, grid (B, H, cdiv(P, BLOCK_P)): one program owns the (BLOCK_P, N) tile of one head's
    state. It reads that tile once, keeps it in registers for the K rows, and computes its own conv channels
    on the fly: the BLOCK_P x channels of its head and the N + N B_g/C_g channels of its group (B_g/C_g are shared by
    the H/G heads of a group, so every head block recomputes them; that is a few hundred FLOPs per row,
    cheaper than another launch). It writes y, the K stash rows, the live state tile, and conv_stash for the
    channels it owns (x channels by their head block, B_g/C_g channels by the first head block of the group), so
    every conv_stash channel is written once.
  _conv_window_kernel, grid (B, cdiv(C, BLOCK_C)): conv_state[s] = conv_stash[b, :, K:]. conv_state is updated
    in place and the B_g/C_g channels of a group are read by every head block of that group; no program of the
    first launch could know that all the others have read the old window, so the update comes after it.
"""
import torch

from nano_spec_kernels.common import (FLOAT, INT, ROW, Arg, Checker, Launch, conv_silu_ref, launch, load_conv_weights,
                                      load_head_params, mamba_channels, mamba_dt, mamba_dt_ref, silu, split_xbc, tl,
                                      triton)

_check = Checker("mamba_verify")
_ARGS = {
    "xBC": Arg("B K C", FLOAT, ROW), "dt": Arg("B K H", FLOAT, ROW),
    "conv_weight": Arg("C W"), "conv_bias": Arg("C"), "dt_bias, A_log, D": Arg("H"),
    "ssm_state": Arg("S H P N", torch.float32), "ssm_stash": Arg("B K H P N", torch.float32),
    "conv_state": Arg("S C W-1"), "conv_stash": Arg("B C W-1+K", "conv_state"), "slot_ids": Arg("B", INT),
}


def mamba_verify_ref(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D,
                     ssm_stash, conv_stash, n_groups: int, dt_limit=(0.0, float("inf"))):
    """xBC (B, K, C), dt (B, K, H); conv_state (S, C, W-1) and ssm_state (S, H, P, N) fp32 of one layer,
    updated in place at slot_ids (B,); ssm_stash (B, K, H, P, N) fp32 and conv_stash (B, C, W-1+K) written.
    Returns y (B, K, H, P) in xBC's dtype."""
    Bsz, K, C = xBC.shape
    H, P = ssm_state.shape[1], ssm_state.shape[2]
    window = torch.cat([conv_state[slot_ids], xBC.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (B, C, W-1+K)
    conv_stash.copy_(window)
    x, B_g, C_g = split_xbc(conv_silu_ref(window, conv_weight, conv_bias), H, P, n_groups)  # (B, K, ...)
    dt = mamba_dt_ref(dt, dt_bias, dt_limit)  # (B, K, H)
    A = -torch.exp(A_log.float())
    G, N = n_groups, B_g.shape[-1]
    xf = x.float()
    # the decays and rank-1 updates of all K rows at once; heads viewed as (G, H/G) so B and C broadcast
    decay = torch.exp(dt * A)[..., None, None]  # (B, K, H, 1, 1)
    upd = ((dt[..., None] * xf).reshape(Bsz, K, G, H // G, P, 1) * B_g.float().reshape(Bsz, K, G, 1, 1, N))
    upd = upd.reshape(Bsz, K, H, P, N)
    state = ssm_state[slot_ids].float()  # (B, H, P, N)
    for j in range(K):  # the one sequential part, two ops per row, straight into the stash
        state = torch.mul(decay[:, j], state, out=ssm_stash[:, j]).add_(upd[:, j])
    y = (ssm_stash.reshape(Bsz, K, G, H // G, P, N) @ C_g.float().reshape(Bsz, K, G, 1, N, 1)).reshape(Bsz, K, H, P)
    y = y + D.float()[:, None] * xf
    ssm_state[slot_ids] = state
    conv_state[slot_ids] = window[:, :, K:]
    return y.to(xBC.dtype)


@triton.jit
def _conv_silu_row(p_conv_state, p_xbc_b, j, stride_xk, o_c, m_c, b_w, b_bias,
                   Wm1: tl.constexpr, BLOCK_W: tl.constexpr):
    """silu(conv) of row j for the channels o_c: the filter reads window positions j .. j+W-1,
    position i < W-1 from the slot's conv_state, i >= W-1 from xBC row i-(W-1)."""
    o_w = tl.arange(0, BLOCK_W)
    i = j + o_w  # (BLOCK_W,) window positions
    m_w = o_w <= Wm1
    m_old = m_c[:, None] & (m_w & (i < Wm1))[None, :]
    m_new = m_c[:, None] & (m_w & (i >= Wm1))[None, :]
    b_old = tl.load(p_conv_state + o_c[:, None] * Wm1 + i[None, :], mask=m_old, other=0.0)
    # new inputs are rounded to the conv state's dtype first, like the window the reference builds
    b_new = tl.load(p_xbc_b + (i[None, :] - Wm1) * stride_xk + o_c[:, None], mask=m_new, other=0.0)
    b_new = b_new.to(p_conv_state.dtype.element_ty)
    b_win = b_old.to(tl.float32) + b_new.to(tl.float32)  # (BLOCK_C, BLOCK_W), disjoint masks
    return silu(tl.sum(b_win * b_w, axis=1) + b_bias)


@triton.jit
def _store_window(p_conv_state, p_xbc_b, p_stash_b, K, stride_xk, o_c, m_c, Wm1: tl.constexpr, BLOCK_L: tl.constexpr):
    """conv_stash[b, o_c, :] = [conv_state[s, o_c] | xBC[b, :, o_c]]   (channels, W-1+K)."""
    o_l = tl.arange(0, BLOCK_L)
    m_old = m_c[:, None] & (o_l < Wm1)[None, :]
    m_new = m_c[:, None] & ((o_l >= Wm1) & (o_l < Wm1 + K))[None, :]
    b_old = tl.load(p_conv_state + o_c[:, None] * Wm1 + o_l[None, :], mask=m_old, other=0.0)
    b_new = tl.load(p_xbc_b + (o_l[None, :] - Wm1) * stride_xk + o_c[:, None], mask=m_new, other=0.0)
    ty = p_stash_b.dtype.element_ty
    b_win = tl.where(m_old, b_old.to(ty), b_new.to(ty))
    tl.store(p_stash_b + o_c[:, None] * (Wm1 + K) + o_l[None, :], b_win, mask=m_old | m_new)


@triton.jit
def _mamba_verify_kernel(
    p_xbc, p_dt, p_conv_state, p_ssm_state, p_slot, p_conv_w, p_conv_b, p_dt_bias, p_A_log, p_D,
    p_ssm_stash, p_conv_stash, p_y,
    K, C, dt_lo, dt_hi,
    stride_xb, stride_xk, stride_db, stride_dk,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, W: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr,
):
    i_b, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    Wm1: tl.constexpr = W - 1
    i_s = tl.load(p_slot + i_b).to(tl.int64)

    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    o_w = tl.arange(0, BLOCK_W)
    m_p, m_n = o_p < P, o_n < N
    # conv channels: x of head i_h, B_g and C_g of its group
    o_cx, o_cb, o_cc = mamba_channels(i_h, o_p, o_n, H, P, N, G)

    # conv weights (channels, W) and biases, loaded once for the K rows
    b_wx, b_bx = load_conv_weights(p_conv_w, p_conv_b, o_cx, m_p, o_w, W, HAS_BIAS)
    b_wb, b_bb = load_conv_weights(p_conv_w, p_conv_b, o_cb, m_n, o_w, W, HAS_BIAS)
    b_wc, b_bc = load_conv_weights(p_conv_w, p_conv_b, o_cc, m_n, o_w, W, HAS_BIAS)
    b_A, b_D, b_dt_bias = load_head_params(p_A_log, p_D, p_dt_bias, i_h)

    p_cs = p_conv_state + i_s * C * Wm1  # (C, W-1) window of slot s
    p_xb = p_xbc + i_b * stride_xb  # (K, C) new conv inputs of sequence b
    o_pn = o_p[:, None] * N + o_n[None, :]
    m_pn = m_p[:, None] & m_n[None, :]
    HPN = H * P * N
    p_state = p_ssm_state + i_s * HPN + i_h * P * N + o_pn
    b_s = tl.load(p_state, mask=m_pn, other=0.0)  # (BLOCK_P, BLOCK_N) fp32, read once

    for j in range(K):
        b_x = _conv_silu_row(p_cs, p_xb, j, stride_xk, o_cx, m_p, b_wx, b_bx, Wm1, BLOCK_W)
        b_B = _conv_silu_row(p_cs, p_xb, j, stride_xk, o_cb, m_n, b_wb, b_bb, Wm1, BLOCK_W)
        b_C = _conv_silu_row(p_cs, p_xb, j, stride_xk, o_cc, m_n, b_wc, b_bc, Wm1, BLOCK_W)
        b_dt = mamba_dt(tl.load(p_dt + i_b * stride_db + j * stride_dk + i_h).to(tl.float32) + b_dt_bias, dt_lo, dt_hi)
        # S = exp(dt A) S + (dt x) B^T ;  y = S C + D x   (same operation order as ssm_step_ref)
        b_s = tl.exp(b_dt * b_A) * b_s + (b_dt * b_x)[:, None] * b_B[None, :]
        b_yj = tl.sum(b_s * b_C[None, :], axis=1) + b_D * b_x
        tl.store(p_ssm_stash + (i_b * K + j).to(tl.int64) * HPN + i_h * P * N + o_pn, b_s, mask=m_pn)
        tl.store(p_y + ((i_b * K + j) * H + i_h) * P + o_p, b_yj.to(p_y.dtype.element_ty), mask=m_p)
    tl.store(p_state, b_s, mask=m_pn)

    # conv_stash[b]: each channel written by exactly one program
    p_stash_b = p_conv_stash + i_b.to(tl.int64) * C * (Wm1 + K)
    _store_window(p_cs, p_xb, p_stash_b, K, stride_xk, o_cx, m_p, Wm1, BLOCK_L)
    # B_g/C_g channels: the group's first head block only (a vector compare: the interpreter mis-types mask & bool)
    m_own = m_n & ((o_n * 0 + (i_h % (H // G)) + i_p) == 0)
    _store_window(p_cs, p_xb, p_stash_b, K, stride_xk, o_cb, m_own, Wm1, BLOCK_L)
    _store_window(p_cs, p_xb, p_stash_b, K, stride_xk, o_cc, m_own, Wm1, BLOCK_L)


@triton.jit
def _conv_window_kernel(p_conv_stash, p_conv_state, p_slot, K, C,
                        Wm1: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    # conv_state[s] (C, W-1) = conv_stash[b, :, K : K+W-1]  (the last W-1 inputs)
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    i_s = tl.load(p_slot + i_b).to(tl.int64)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    o_w = tl.arange(0, BLOCK_W)
    m = (o_c < C)[:, None] & (o_w < Wm1)[None, :]
    b_w = tl.load(p_conv_stash + i_b.to(tl.int64) * C * (Wm1 + K) + o_c[:, None] * (Wm1 + K) + K + o_w[None, :], mask=m)
    tl.store(p_conv_state + i_s * C * Wm1 + o_c[:, None] * Wm1 + o_w[None, :], b_w, mask=m)


def mamba_verify_plan(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D,
                      ssm_stash, conv_stash, n_groups: int, dt_limit=(0.0, float("inf")), *, cuda: bool, n_sm: int):
    d = _check.args(_ARGS, xBC=xBC, dt=dt, conv_weight=conv_weight, conv_bias=conv_bias, dt_bias=dt_bias, A_log=A_log,
                    D=D, ssm_state=ssm_state, ssm_stash=ssm_stash, conv_state=conv_state, conv_stash=conv_stash,
                    slot_ids=slot_ids)
    Bsz, K, C, H, P, N, W, G = d.B, d.K, d.C, d.H, d.P, d.N, d.W, n_groups
    _check(W >= 2, f"conv_weight needs a window W >= 2, got {W}")
    _check(G >= 1 and H % G == 0, f"H={H} not divisible by n_groups={G}")
    _check(C == H * P + 2 * G * N, f"C={C} != H*P + 2*G*N = {H * P + 2 * G * N}")
    y = torch.empty(Bsz, K, H, P, device=xBC.device, dtype=xBC.dtype)
    if Bsz == 0 or K == 0:
        return [], y
    meta = dict(BLOCK_P=min(triton.next_power_of_2(P), 16), BLOCK_N=triton.next_power_of_2(N),
                BLOCK_W=triton.next_power_of_2(W), BLOCK_L=triton.next_power_of_2(W - 1 + K), num_warps=4)
    window = dict(BLOCK_C=256, BLOCK_W=triton.next_power_of_2(W - 1), num_warps=4)
    return [
        Launch(_mamba_verify_kernel, (Bsz, H, triton.cdiv(P, meta["BLOCK_P"])), (
            xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias if conv_bias is not None else conv_weight,
            dt_bias, A_log, D, ssm_stash, conv_stash, y,
            K, C, float(dt_limit[0]), float(dt_limit[1]),
            xBC.stride(0), xBC.stride(1), dt.stride(0), dt.stride(1),
        ), dict(H=H, P=P, N=N, G=G, W=W, HAS_BIAS=conv_bias is not None, **meta)),
        Launch(_conv_window_kernel, (Bsz, triton.cdiv(C, window["BLOCK_C"])), (conv_stash, conv_state, slot_ids, K, C),
               dict(Wm1=W - 1, **window)),
    ], y


def mamba_verify(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D,
                 ssm_stash, conv_stash, n_groups: int, dt_limit=(0.0, float("inf"))):
    """Triton version of mamba_verify_ref (same arguments and writes). xBC and dt may be strided
    views with a unit last-dim stride; slot_ids must be distinct (not checked: no host sync)."""
    return launch(mamba_verify_plan, xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias,
                  A_log, D, ssm_stash, conv_stash, n_groups, dt_limit)


def mamba_verify_bytes(B: int, K: int, H: int, P: int, N: int, G: int, W: int, act: int, param: int | None = None,
                       bias: bool = True) -> dict:
    """The bytes one call moves, by tensor: what each of its two launches loads or stores, every element once per
    launch (the B_g/C_g channels each head block of a group reads again come from L2). act: bytes of an activation and
    of the conv state, param: of a layer weight (act when None); the ssm state and stash are fp32, ids int64.
    The K stash states (4*K*H*P*N per sequence) are most of it."""
    param = act if param is None else param
    C, HPN = H * P + 2 * G * N, H * P * N
    return {
        "xBC": B * K * C * act, "dt": B * K * H * act, "conv_state read": B * C * (W - 1) * act,
        "ssm_state read": B * HPN * 4, "weights": (C * W + C * bias + 3 * H) * param, "slot_ids": 2 * B * 8,
        "ssm_stash": B * K * HPN * 4, "ssm_state written": B * HPN * 4, "conv_stash": B * C * (W - 1 + K) * act,
        "y": B * K * H * P * act,
        "conv_stash read": B * C * (W - 1) * act, "conv_state written": B * C * (W - 1) * act,  # _conv_window_kernel
    }
