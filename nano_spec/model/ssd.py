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
    T, Cdim = xBC.shape
    H, W = dt.shape[-1], conv_weight.shape[-1]
    # The state is fp32 whatever the weights (docs/DESIGN.md §2), so autocast must not lower these matmuls.
    with torch.autocast(xBC.device.type, enabled=False):
        # 1. causal depthwise conv + SiLU as W shifted multiply-adds over the input padded by W-1 zeros
        #    (torch's depthwise conv1d backward is orders of magnitude slower on CPU).
        xpad = F.pad(xBC.float(), (0, 0, W - 1, 0))  # (W-1+T, C)
        w = conv_weight.float()  # (C, W)
        conv = sum(xpad[k:k + T] * w[:, k] for k in range(W))  # (T, C)
        if conv_bias is not None:
            conv = conv + conv_bias.float()
        xbc = F.silu(conv)  # (T, C)
        G, R = n_groups, H // n_groups  # head h = g R + r reads group g; B_g and C_g are never copied per head
        x, B_g, C_g = split_xbc(xbc, H, head_dim, n_groups)  # (T, H, P), (T, G, N), (T, G, N)
        dt = mamba_dt_ref(dt, dt_bias, dt_limit)  # (T, H) fp32
        A = -torch.exp(A_log.float()).view(G, R)  # (G, R)

        # 2. pad T to c*l; padded steps have dt = 0: decay 1 and no input, so the final state is unchanged.
        l = chunk_size
        c = -(-T // l)
        pad = c * l - T
        x = F.pad(x, (0, 0, 0, 0, 0, pad)).view(c, l, G, R, head_dim)  # (c, l, G, R, P)
        B_g, C_g = (F.pad(t, (0, 0, 0, 0, 0, pad)).view(c, l, G, -1) for t in (B_g, C_g))  # (c, l, G, N)
        dt = F.pad(dt, (0, 0, 0, pad)).view(c, l, G, R)  # (c, l, G, R)
        a = (dt * A).permute(0, 2, 3, 1)  # (c, G, R, l): log-decay of each step
        a_cum = a.cumsum(dim=-1)  # (c, G, R, l)
        xdt = x * dt[..., None]  # (c, l, G, R, P): the input term dt_j x_j

        # 3. inside each chunk, the quadratic (attention-like) form: (C_i . B_j) L_ij dt_j x_j for j <= i.
        CB = torch.einsum("cign,cjgn->cgij", C_g, B_g)  # (c, G, l, l), shared by the R heads of a group
        scores = CB[:, :, None] * torch.exp(segsum(a))  # (c, G, R, l, l)
        y_diag = torch.einsum("cgrij,cjgrp->cigrp", scores, xdt)  # (c, l, G, R, P)

        # 4. each chunk's own end state from zero: sum_j exp(a_{j+1} + ... + a_last) dt_j x_j B_j^T.
        to_end = torch.exp(a_cum[..., -1:] - a_cum).permute(0, 3, 1, 2)  # (c, l, G, R)
        states = torch.einsum("cjgrp,cjgn->cgrpn", xdt * to_end[..., None], B_g)  # (c, G, R, P, N)

        # 5. pass states across chunks: the state entering chunk k is sum_{k' < k} (decay of chunks
        #    k'+1 .. k-1) * states[k'], again a segsum, now over the c chunk totals (plus a zero start).
        totals = F.pad(a_cum[..., -1].permute(1, 2, 0), (1, 0))  # (G, R, c+1): log-decay across each chunk
        across = torch.exp(segsum(totals))  # (G, R, c+1, c+1)
        states = torch.cat([states.new_zeros(1, *states.shape[1:]), states])  # (c+1, G, R, P, N)
        passed = torch.einsum("grkj,jgrpn->kgrpn", across, states)  # (c+1, G, R, P, N)
        entering, final = passed[:-1], passed[-1].reshape(H, head_dim, -1)  # (c, G, R, P, N), (H, P, N)

        # 6. the entering state's contribution inside its chunk, decayed to each position i.
        y_off = torch.einsum("cign,cgrpn->cigrp", C_g, entering)  # (c, l, G, R, P)
        y_off = y_off * torch.exp(a_cum).permute(0, 3, 1, 2)[..., None]

        # 7. sum, the D skip, drop the padding.
        y = (y_diag + y_off + D.float().view(G, R, 1) * x).reshape(c * l, H, head_dim)[:T]  # (T, H, P)

    window = torch.cat([xBC.new_zeros(Cdim, W - 1), xBC.t()], dim=-1)[:, T:]  # (C, W-1): last W-1 inputs
    return y.to(xBC.dtype), final, window.clone()
