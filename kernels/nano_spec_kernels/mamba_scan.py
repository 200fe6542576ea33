"""Mamba2 prefill: conv1d + SiLU, dt, and the SSM recurrence over the T tokens of one prompt,
from zero state. Per head h of group g, with a_t = dt_t A_h (a log decay, <= 0):

    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t + D_h x_t        (recurrent form)

One Triton kernel computes it in either of two forms, one program per (head, block of BLOCK_P head dims) computing
its conv channels on the fly (x of its head, B_g and C_g of its group, which every head block of the group recomputes):

  recurrent (Q = 1): a loop over the T tokens, the (BLOCK_P, N) state in registers.
  chunked (SSD): tokens in chunks of Q. With cumulative log decays
    Acum_t = sum_{tau <= t, same chunk} a_tau, inside a chunk starting from state S_prev:

      y_t   = sum_{s <= t} (C_t . B_s) exp(Acum_t - Acum_s) dt_s x_s     intra-chunk, (Q,Q)@(Q,P) tl.dot
            + exp(Acum_t) S_prev C_t                                      output from the state passed in
            + D x_t
      S_end = exp(Acum_last) S_prev + sum_s exp(Acum_last - Acum_s) dt_s x_s B_s^T      chunk state, tl.dot

    The chunks of a head are walked in order inside the program (state passing in registers), so one launch
    does intra-chunk outputs, chunk states, state passing and the chunk output, with fp32 ("ieee") matmuls to
    match the reference.
"""
import torch

from nano_spec_kernels.common import (FLOAT, ROW, Arg, Checker, Launch, conv_silu_ref, launch, load_conv_weights,
                                      load_head_params, mamba_channels, mamba_dt, mamba_dt_ref, pow2, silu,
                                      split_xbc, ssm_step_ref, tl, triton)

# Q: tokens per chunk of the SSD form. tl.dot wants >= 16; with N = 128 a chunk of 32 needs more than 255 registers
# per thread on sm_90 and spills at any warp count (its dots are "ieee", on the FMA units), 16 does not.
CHUNK = 16

_check = Checker("mamba_scan")
_ARGS = {"xBC": Arg("T C", FLOAT, ROW), "dt": Arg("T H", FLOAT, ROW),
         "conv_weight": Arg("C W"), "conv_bias": Arg("C"), "dt_bias, A_log, D": Arg("H")}


def mamba_scan_ref(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, n_groups: int, head_dim: int,
                   dt_limit=(0.0, float("inf"))):
    """xBC (T, C) conv inputs, dt (T, H) raw time steps; conv_weight (C, W), conv_bias (C,) or None,
    dt_bias, A_log, D (H,) -> (y (T, H, P) with the D skip, in xBC's dtype; final ssm_state
    (H, P, N) fp32; final conv window (C, W-1): the last W-1 conv inputs, zeros where T < W-1)."""
    T, C = xBC.shape
    H, W = dt.shape[-1], conv_weight.shape[-1]
    window = torch.cat([xBC.new_zeros(C, W - 1), xBC.t()], dim=-1)  # (C, W-1+T)
    x, B_g, C_g = split_xbc(conv_silu_ref(window, conv_weight, conv_bias), H, head_dim, n_groups)
    dt = mamba_dt_ref(dt, dt_bias, dt_limit)  # (T, H)
    A = -torch.exp(A_log.float())
    state = torch.zeros(H, head_dim, B_g.shape[-1], dtype=torch.float32, device=xBC.device)
    ys = []
    for t in range(T):
        state, y = ssm_step_ref(state, x[t], B_g[t], C_g[t], dt[t], A, D)
        ys.append(y)
    return torch.stack(ys).to(xBC.dtype), state, window[:, T:].clone()


@triton.jit
def _conv_silu_tokens(p_xbc, p_conv_w, p_conv_b, stride_t, o_t, m_t, o_c, m_c, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    """silu(causal conv) for tokens o_t (rows) and channels o_c (cols) -> (len(o_t), len(o_c)) fp32;
    inputs before token 0 are the zero padding of the prompt's fresh window."""
    b_acc = tl.zeros([o_t.shape[0], o_c.shape[0]], dtype=tl.float32)
    for w in tl.static_range(W):
        i = o_t - (W - 1) + w  # input token of tap w
        m = (m_t & (i >= 0))[:, None] & m_c[None, :]
        b_in = tl.load(p_xbc + i[:, None] * stride_t + o_c[None, :], mask=m, other=0.0).to(tl.float32)
        b_w = tl.load(p_conv_w + o_c * W + w, mask=m_c, other=0.0).to(tl.float32)
        b_acc += b_in * b_w[None, :]
    if HAS_BIAS:
        b_acc += tl.load(p_conv_b + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    return silu(b_acc)


@triton.jit
def _store_conv_window(p_xbc, p_win, T, stride_t, o_c, m_c, Wm1: tl.constexpr, BLOCK_W: tl.constexpr):
    """conv_window[o_c, w] = xBC[T-(W-1)+w, o_c], zero before token 0."""
    o_w = tl.arange(0, BLOCK_W)
    i = T - Wm1 + o_w
    m = m_c[:, None] & (o_w < Wm1)[None, :]
    b = tl.load(p_xbc + i[None, :] * stride_t + o_c[:, None], mask=m & (i >= 0)[None, :], other=0.0)
    tl.store(p_win + o_c[:, None] * Wm1 + o_w[None, :], b, mask=m)


@triton.jit
def _mamba_scan_kernel(
    p_xbc, p_dt, p_conv_w, p_conv_b, p_dt_bias, p_A_log, p_D, p_y, p_state, p_win,
    T, dt_lo, dt_hi, stride_t, stride_dt,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr, W: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    Q: tl.constexpr,
):
    """grid (H, cdiv(P, BLOCK_P)): the recurrent form when Q = 1, else the chunked form in chunks of Q tokens."""
    i_h, i_p = tl.program_id(0), tl.program_id(1)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_p, m_n = o_p < P, o_n < N
    o_cx, o_cb, o_cc = mamba_channels(i_h, o_p, o_n, H, P, N, G)  # conv channels: x of head h, B_g and C_g of group g
    b_A, b_D, b_dt_bias = load_head_params(p_A_log, p_D, p_dt_bias, i_h)
    b_s = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)  # (BLOCK_P, N) state: zero initially, then entering a chunk

    if Q == 1:
        o_w = tl.arange(0, BLOCK_W)  # conv filter positions, BLOCK_W >= W here
        # window tiles (channels, taps): token t reads inputs t-(W-1)+w; pointers and weights hoisted
        m_xw = m_p[:, None] & (o_w < W)[None, :]
        m_nw = m_n[:, None] & (o_w < W)[None, :]
        p_wx = p_xbc + (o_w[None, :] - (W - 1)) * stride_t + o_cx[:, None]
        p_wb = p_xbc + (o_w[None, :] - (W - 1)) * stride_t + o_cb[:, None]
        p_wc = p_xbc + (o_w[None, :] - (W - 1)) * stride_t + o_cc[:, None]
        b_wx, b_bx = load_conv_weights(p_conv_w, p_conv_b, o_cx, m_p, o_w, W, HAS_BIAS)
        b_wb, b_bb = load_conv_weights(p_conv_w, p_conv_b, o_cb, m_n, o_w, W, HAS_BIAS)
        b_wc, b_bc = load_conv_weights(p_conv_w, p_conv_b, o_cc, m_n, o_w, W, HAS_BIAS)
        p_yt = p_y + i_h * P + o_p
        for t in range(T):
            o_xt = t * stride_t  # offset of token t
            m_tap = (o_w + t >= W - 1)[None, :]  # taps before token 0 read the zero padding
            b_x = silu(tl.sum(tl.load(p_wx + o_xt, mask=m_xw & m_tap, other=0.0).to(tl.float32) * b_wx, axis=1) + b_bx)
            b_B = silu(tl.sum(tl.load(p_wb + o_xt, mask=m_nw & m_tap, other=0.0).to(tl.float32) * b_wb, axis=1) + b_bb)
            b_C = silu(tl.sum(tl.load(p_wc + o_xt, mask=m_nw & m_tap, other=0.0).to(tl.float32) * b_wc, axis=1) + b_bc)
            b_dt = mamba_dt(tl.load(p_dt + t * stride_dt + i_h).to(tl.float32) + b_dt_bias, dt_lo, dt_hi)
            b_s = tl.exp(b_dt * b_A) * b_s + (b_dt * b_x)[:, None] * b_B[None, :]
            b_y = tl.sum(b_s * b_C[None, :], axis=1) + b_D * b_x
            tl.store(p_yt + t * (H * P), b_y.to(p_y.dtype.element_ty), mask=m_p)
    else:
        o_q = tl.arange(0, Q)
        m_causal = o_q[:, None] >= o_q[None, :]  # (Q, Q): token t sees s <= t
        for t0 in range(0, T, Q):
            o_t = t0 + o_q
            m_t = o_t < T
            # x (Q, BLOCK_P), B_g and C_g (Q, BLOCK_N)
            b_x = _conv_silu_tokens(p_xbc, p_conv_w, p_conv_b, stride_t, o_t, m_t, o_cx, m_p, W, HAS_BIAS)
            b_B = _conv_silu_tokens(p_xbc, p_conv_w, p_conv_b, stride_t, o_t, m_t, o_cb, m_n, W, HAS_BIAS)
            b_C = _conv_silu_tokens(p_xbc, p_conv_w, p_conv_b, stride_t, o_t, m_t, o_cc, m_n, W, HAS_BIAS)
            b_dt = tl.load(p_dt + o_t * stride_dt + i_h, mask=m_t, other=0.0).to(tl.float32) + b_dt_bias
            b_dt = tl.where(m_t, mamba_dt(b_dt, dt_lo, dt_hi), 0.0)  # (Q,): padding tokens: dt = 0
            b_a = b_dt * b_A  # (Q,) log decays; 0 on padding, so the chunk total is exact
            b_acum = tl.cumsum(b_a, axis=0)  # (Q,)
            b_alast = tl.sum(b_a, axis=0)
            # segment sums Acum_t - Acum_s = sum_{s < tau <= t} a_tau, summed directly rather than
            # subtracted: the difference of two large cumulative sums loses digits (decays reach -100s)
            b_segsum = tl.cumsum(tl.where(o_q[:, None] > o_q[None, :], b_a[:, None], 0.0), axis=0)  # (Q, Q)
            b_tail = tl.sum(tl.where(o_q[:, None] == Q - 1, b_segsum, 0.0), axis=0)  # (Q,): Acum_last - Acum_s

            # intra-chunk: M[t, s] = (C_t . B_s) exp(Acum_t - Acum_s) dt_s for s <= t
            b_cb = tl.dot(b_C, tl.trans(b_B), input_precision="ieee")  # (Q, Q)
            b_m = b_cb * tl.exp(tl.where(m_causal, b_segsum, -float("inf"))) * b_dt[None, :]
            b_y = tl.dot(b_m, b_x, input_precision="ieee")  # (Q, BLOCK_P)
            # from the state passed in: exp(Acum_t) (C_t S_prev^T)
            b_y += tl.exp(b_acum)[:, None] * tl.dot(b_C, tl.trans(b_s), input_precision="ieee")
            b_y += b_D * b_x
            p_y_blk = p_y + (o_t[:, None] * H + i_h) * P + o_p[None, :]
            tl.store(p_y_blk, b_y.to(p_y.dtype.element_ty), mask=m_t[:, None] & m_p[None, :])

            # state passing: S = exp(Acum_last) S + sum_s exp(Acum_last - Acum_s) dt_s x_s B_s^T
            b_xw = b_x * (tl.exp(b_tail) * b_dt)[:, None]  # (Q, BLOCK_P)
            b_s = tl.exp(b_alast) * b_s + tl.dot(tl.trans(b_xw), b_B, input_precision="ieee")

    tl.store(p_state + (i_h * P + o_p[:, None]) * N + o_n[None, :], b_s, mask=m_p[:, None] & m_n[None, :])
    # final window: x channels by their head block, B_g/C_g by the group's first head block
    # (vector compare: the interpreter mis-types block mask & scalar bool)
    _store_conv_window(p_xbc, p_win, T, stride_t, o_cx, m_p, W - 1, BLOCK_W)
    m_own = m_n & ((o_n * 0 + (i_h % (H // G)) + i_p) == 0)
    _store_conv_window(p_xbc, p_win, T, stride_t, o_cb, m_own, W - 1, BLOCK_W)
    _store_conv_window(p_xbc, p_win, T, stride_t, o_cc, m_own, W - 1, BLOCK_W)


def scan_meta(method: str, P: int, N: int, W: int) -> dict:
    """Meta-parameters of the "recurrent" or "chunked" form (scripts/compile_check.py compiles these):
    16 head dims per program, more programs for few heads; tl.dot needs blocks >= 16. The chunked form: 8 warps
    (16 cap a thread at 128 registers and spill), 2 stages (the next chunk's loads in flight; a third adds shared
    memory and registers but no occupancy: 8 warps at ~220 registers fill an SM's register file already)."""
    common = dict(BLOCK_N=pow2(N), BLOCK_W=triton.next_power_of_2(W))
    if method == "recurrent":
        return dict(common, BLOCK_P=min(triton.next_power_of_2(P), 16), Q=1, num_warps=4)
    return dict(common, BLOCK_P=16, Q=CHUNK, num_warps=8, num_stages=2)


def mamba_scan_plan(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, n_groups: int, head_dim: int,
                    dt_limit=(0.0, float("inf")), method: str = "auto", *, cuda: bool, n_sm: int):
    _check(method in ("auto", "recurrent", "chunked"), f"unknown method {method!r}")
    d = _check.args(_ARGS, xBC=xBC, dt=dt, conv_weight=conv_weight, conv_bias=conv_bias, dt_bias=dt_bias,
                    A_log=A_log, D=D)
    T, C, H, W, P, G = d.T, d.C, d.H, d.W, head_dim, n_groups
    _check(W >= 2, f"conv_weight needs a window W >= 2, got {W}")
    _check(G >= 1 and H % G == 0, f"H={H} not divisible by n_groups={G}")
    _check(P >= 1 and C > H * P and (C - H * P) % (2 * G) == 0, f"C={C} is not H*P={H * P} + 2*G*N")
    N = (C - H * P) // (2 * G)

    y = torch.empty(T, H, P, device=xBC.device, dtype=xBC.dtype)
    state = torch.empty(H, P, N, device=xBC.device, dtype=torch.float32)
    window = torch.empty(C, W - 1, device=xBC.device, dtype=xBC.dtype)
    if method == "auto":
        method = "chunked" if (cuda and T >= 2 * CHUNK) else "recurrent"
    meta = scan_meta(method, P, N, W)
    args = (xBC, dt, conv_weight, conv_bias if conv_bias is not None else conv_weight, dt_bias, A_log, D,
            y, state, window, T, float(dt_limit[0]), float(dt_limit[1]), xBC.stride(0), dt.stride(0))
    return [Launch(_mamba_scan_kernel, (H, triton.cdiv(P, meta["BLOCK_P"])), args,
                   dict(H=H, P=P, N=N, G=G, W=W, HAS_BIAS=conv_bias is not None, **meta))], (y, state, window)


def mamba_scan(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, n_groups: int, head_dim: int,
               dt_limit=(0.0, float("inf")), method: str = "auto"):
    """Triton version of mamba_scan_ref, plus `method`: "recurrent", "chunked" (SSD, chunks of CHUNK
    tokens) or "auto" (chunked on CUDA when T >= 2*CHUNK). xBC and dt may be row-strided views."""
    return launch(mamba_scan_plan, xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, n_groups, head_dim, dt_limit,
                  method)


def mamba_scan_bytes(T: int, H: int, P: int, N: int, G: int, W: int, act: int, param: int | None = None,
                     bias: bool = True) -> dict:
    """The bytes one call moves, by tensor: what its one launch loads or stores, every element once (the B_g/C_g
    channels that every head block of a group reads again, and the last W-1 tokens the conv window copies, come from
    L2). act: bytes of an element of xBC, dt and y and of the conv window, param: of a layer weight (act when None);
    the final ssm state is fp32."""
    param = act if param is None else param
    C = H * P + 2 * G * N
    return {"xBC": T * C * act, "dt": T * H * act, "weights": (C * W + C * bias + 3 * H) * param,
            "y": T * H * P * act, "ssm_state written": H * P * N * 4, "conv window written": C * (W - 1) * act}
