"""Mamba2 prefill as chunked SSD ("state space duality"), plain torch and differentiable.

The recurrence of nano_spec_kernels/mamba_scan.py, per head h of group g,

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T        y_t = S_t C_t + D x_t,

unrolled from S_{-1} = 0 is a masked matrix product: y_i = sum_{j<=i} (C_i . B_j) L_ij dt_j x_j
with L_ij = exp(dt_{j+1} A + ... + dt_i A), a lower-triangular decay. Materialising the (T, T)
matrix costs O(T^2); SSD cuts T into chunks of l tokens, does the quadratic form inside each
chunk (matmuls, which autograd and BLAS like) and passes one (P, N) state per head between
chunks. That is what makes training fast where the reference's Python loop over T is not.

Shapes (docs/DESIGN.md §1; the Mamba projections are B_g and C_g, so that B and C stay the batch and conv_dim):
    T   tokens                 l   chunk length (chunk_size)     c   chunks = ceil(T / l)
    C   conv_dim = H*P + 2*G*N     W   conv width
    H, P, N, G   Mamba heads, head dim, state size, groups;  R = H / G heads per group (h = g*R + r)
"""
import torch
import torch.nn.functional as F

from nano_spec_kernels.common import mamba_dt_ref, split_xbc

INF = float("inf")


def segsum(a):
    """a (..., l) -> (..., l, l) with out[i, j] = a[j+1] + ... + a[i] for i >= j, -inf above the diagonal.

    Summing masked copies, rather than subtracting two entries of one long cumsum, keeps every
    entry a sum of its own few terms: no cancellation error, and no inf - inf where it is masked.
    """
    l = a.shape[-1]
    rep = a[..., None].expand(*a.shape, l)  # rep[..., i, j] = a[i]
    below = torch.tril(torch.ones(l, l, dtype=torch.bool, device=a.device), diagonal=-1)
    s = rep.masked_fill(~below, 0).cumsum(dim=-2)  # s[i, j] = a[j+1] + ... + a[i] for i > j
    return s.masked_fill(below.T, -INF)  # below.T: i < j


def mamba_scan_chunked(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, n_groups: int, head_dim: int,
                       dt_limit=(0.0, INF), *, chunk_size: int = 64):
    """Same contract as nano_spec_kernels.mamba_scan.mamba_scan_ref: xBC (T, C) conv inputs, dt (T, H) raw time steps;
    conv_weight (C, W), conv_bias (C,) or None, dt_bias, A_log, D (H,)
    -> (y (T, H, P) in xBC's dtype, ssm_state (H, P, N) fp32, conv_window (C, W-1))."""
    T = xBC.shape[0]
    H, W = dt.shape[-1], conv_weight.shape[-1]
    # The state is fp32 whatever the weights (docs/DESIGN.md §2), so autocast must not lower these matmuls.
    with torch.autocast(xBC.device.type, enabled=False):
        # 1. causal depthwise conv + SiLU
        xbc = conv_silu_tokens(xBC, conv_weight, conv_bias)  # (T, C)
        G, R = n_groups, H // n_groups  # head h = g R + r reads group g; B_g and C_g are never copied per head
        x, B_g, C_g = split_xbc(xbc, H, head_dim, n_groups)  # (T, H, P), (T, G, N), (T, G, N)
        N = B_g.shape[-1]
        dt = mamba_dt_ref(dt, dt_bias, dt_limit)  # (T, H) fp32
        A = -torch.exp(A_log.float())  # (H,)

        # 2. pad T to c*l (padded steps have dt = 0: decay 1 and no input, so the final state is unchanged), and
        #    lay every tensor out heads first, contiguous, so that each step below is one batched matmul or one
        #    elementwise pass over memory in order (a strided layout costs an elementwise op several times its work).
        l = chunk_size
        c = -(-T // l)
        pad = c * l - T
        x = F.pad(x, (0, 0, 0, 0, 0, pad)).view(c, l, H, head_dim).transpose(1, 2).contiguous()  # (c, H, l, P)
        B_g, C_g = (F.pad(t, (0, 0, 0, 0, 0, pad)).view(c, l, G, -1).transpose(1, 2).contiguous()
                    for t in (B_g, C_g))  # (c, G, l, N)
        dt = F.pad(dt, (0, 0, 0, pad)).view(c, l, H).transpose(1, 2).contiguous()  # (c, H, l)
        a = dt * A[:, None]  # (c, H, l): log-decay of each step
        a_cum = a.cumsum(dim=-1)  # (c, H, l)
        xdt = x * dt[..., None]  # (c, H, l, P): the input term dt_j x_j

        # 3. inside each chunk, the quadratic (attention-like) form: (C_i . B_j) L_ij dt_j x_j for j <= i.
        CB = C_g @ B_g.transpose(-1, -2)  # (c, G, l, l), shared by the R heads of a group
        scores = CB[:, :, None] * torch.exp(segsum(a)).view(c, G, R, l, l)  # (c, G, R, l, l)
        y_diag = scores.view(c, H, l, l) @ xdt  # (c, H, l, P)

        # 4. each chunk's own end state from zero: sum_j exp(a_{j+1} + ... + a_last) dt_j x_j B_j^T.
        to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (c, H, l)
        u = (xdt * to_end[..., None]).view(c, G, R, l, head_dim)  # (c, G, R, l, P)
        states = u.transpose(-1, -2) @ B_g[:, :, None]  # (c, G, R, P, N)

        # 5. pass states across chunks: the state entering chunk k is sum_{k' < k} (decay of chunks
        #    k'+1 .. k-1) * states[k'], again a segsum, now over the c chunk totals (plus a zero start).
        totals = F.pad(a_cum[..., -1].t(), (1, 0))  # (H, c+1): log-decay across each chunk
        across = torch.exp(segsum(totals))  # (H, c+1, c+1)
        states = torch.cat([states.new_zeros(1, H, head_dim * N), states.view(c, H, head_dim * N)])  # (c+1, H, P*N)
        passed = across @ states.transpose(0, 1)  # (H, c+1, P*N)
        final = passed[:, -1].reshape(H, head_dim, N)  # (H, P, N)
        entering = passed[:, :-1].transpose(0, 1).reshape(c, G, R, head_dim, N)  # (c, G, R, P, N)

        # 6. the entering state's contribution inside its chunk, decayed to each position i.
        y_off = (C_g[:, :, None] @ entering.transpose(-1, -2)).view(c, H, l, head_dim)  # (c, H, l, P)
        y_off = y_off * torch.exp(a_cum)[..., None]

        # 7. sum, the D skip, back to tokens first, drop the padding.
        y = y_diag + y_off + D.float().view(H, 1, 1) * x  # (c, H, l, P)
        y = y.transpose(1, 2).reshape(c * l, H, head_dim)[:T]  # (T, H, P)

    return y.to(xBC.dtype), final, last_window(xBC, W)


def conv_silu_tokens(xBC, conv_weight, conv_bias):
    """silu(causal depthwise conv1d) of a prompt from a zero window: xBC (T, C), conv_weight (C, W), conv_bias (C,) or
    None -> (T, C) fp32, as W shifted multiply-adds over the input padded by W-1 zeros (torch's depthwise conv1d
    backward is orders of magnitude slower on CPU), each tap's weights a contiguous row."""
    T, W = xBC.shape[0], conv_weight.shape[-1]
    xpad = F.pad(xBC.float(), (0, 0, W - 1, 0))  # (W-1+T, C)
    w = conv_weight.float().t().contiguous()  # (W, C)
    conv = sum(xpad[k:k + T] * w[k] for k in range(W))  # (T, C)
    if conv_bias is not None:
        conv = conv + conv_bias.float()
    return F.silu(conv)


def last_window(xBC, W: int):
    """A prompt's final conv window: xBC (T, C) -> its last W-1 rows as columns (C, W-1), zeros before the first."""
    T = xBC.shape[0]
    keep = min(T, W - 1)
    return F.pad(xBC[T - keep:].t(), (W - 1 - keep, 0)).contiguous()
