"""The ops a step graph runs in place of the eager ones (docs/DESIGN.md §12); nano_spec/engine/graph.py binds them.

Under torch.compile the Mamba and attention math of a verify runs in the graph, where inductor fuses it; only
the cache writes leave it, as opaque operators with their writes declared (`mamba_write`, `kv_write`), so the
graph hands them the cache views and they write in place. Traced instead, a write into a slice of a cache buffer
becomes a copy of the whole buffer and a copy back, every call. In every graph mode the commit is `commit_state`
below: commit_state_ref finds the rows that move with a host sync, which no graph may hold. A compiled CPU step's
products of a few rows by a weight are cpu_rows' (`pack_linears`).
"""
import torch
from torch import Tensor

from nano_spec.model.cpu_rows import library_op, mamba_rows
from nano_spec_kernels.common import apply_rope_ref, conv_silu_ref, mamba_dt_ref, split_xbc


# ---- 1. Mamba: the conv and dt in the graph, the K-row recurrence and the writes in one op -----------
@library_op("mamba_write(Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor(c!) conv_stash, Tensor(d!) ssm_stash, "
            "Tensor slot_ids, Tensor window, Tensor decay, Tensor u, Tensor B, Tensor C) -> Tensor",
            meta=lambda *args: torch.empty_like(args[7]))  # y (B, K, H, P), the shape of u = args[7]
def mamba_write(conv_state: Tensor, ssm_state: Tensor, conv_stash: Tensor, ssm_stash: Tensor, slot_ids: Tensor,
                window: Tensor, decay: Tensor, u: Tensor, B: Tensor, C: Tensor) -> Tensor:
    """The recurrence of the K rows (cpu_rows.mamba_rows: the stash and the live states written, y returned),
    then the conv writes of the window (B, C, W-1+K)."""
    y = mamba_rows(ssm_state, ssm_stash, slot_ids, decay, u, B, C)
    conv_stash.copy_(window)
    conv_state[slot_ids] = window[:, :, window.shape[2] - conv_state.shape[2]:]
    return y


def mamba_verify(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D,
                 ssm_stash, conv_stash, n_groups: int, dt_limit=(0.0, float("inf"))):
    """mamba_verify_ref's contract on the CPU: inductor fuses the conv, dt and decay; the recurrence is C."""
    H, P = ssm_state.shape[1], ssm_state.shape[2]
    window = torch.cat([conv_state[slot_ids], xBC.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (B, C, W-1+K)
    x, Bg, Cg = split_xbc(conv_silu_ref(window, conv_weight, conv_bias), H, P, n_groups)  # (B, K, ...) fp32
    dt = mamba_dt_ref(dt, dt_bias, dt_limit)  # (B, K, H)
    decay = torch.exp(dt * -torch.exp(A_log.float()))  # (B, K, H)
    y = mamba_write(conv_state, ssm_state, conv_stash, ssm_stash, slot_ids, window, decay, dt[..., None] * x, Bg, Cg)
    return (y + D.float()[:, None] * x).to(xBC.dtype)  # y_j = S_j C_j + D x_j


# ---- 2. attention: the K new rows written in one op, then attention over the slot's rows ------------
@library_op("kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_ids, Tensor pos, Tensor k, Tensor v) -> ()")
def kv_write(k_cache: Tensor, v_cache: Tensor, slot_ids: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
    """Rows k, v (B, K, Hkv, Dh) into the caches (S, L, Hkv, Dh) at slots slot_ids (B,), positions pos (B, K)."""
    k_cache[slot_ids[:, None], pos] = k
    v_cache[slot_ids[:, None], pos] = v


def attention_verify(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale: float, rope_theta=None):
    """attention_verify_ref's contract, written for inductor. The rows are written first and then read back
    with the rest: reading the cache before a write of it would make inductor keep a copy of the old cache."""
    Bsz, K, Hq, Dh = q.shape
    L, Hkv = k_cache.shape[1], k.shape[2]
    pos = seq_lens[:, None] + torch.arange(K, device=q.device)  # (B, K)
    kv_write(k_cache, v_cache, slot_ids, pos, apply_rope_ref(k, pos, rope_theta), v)  # k is cached rotated
    # the products as broadcasts and sums, which inductor fuses into its loops: as matmuls they would be its GEMM
    # template too, which copies each operand that is not a weight into a packed buffer first
    qg = apply_rope_ref(q, pos, rope_theta).float().view(Bsz, K, Hkv, Hq // Hkv, Dh)  # grouped by KV head
    qg = qg.permute(0, 2, 3, 1, 4)[:, :, :, :, None]  # (B, Hkv, rep, K, 1, Dh)
    kc = k_cache[slot_ids].float().transpose(1, 2)[:, :, None, None]  # (B, Hkv, 1, 1, L, Dh)
    s = (qg * kc).sum(-1) * scale  # (B, Hkv, rep, K, L)
    visible = torch.arange(L, device=q.device)[None, None, :] <= pos[:, :, None]  # (B, K, L)
    p = s.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
    vc = v_cache[slot_ids].float().transpose(1, 2)[:, :, None, None]  # (B, Hkv, 1, 1, L, Dh)
    o = (p[..., None] * vc).sum(-2)  # (B, Hkv, rep, K, Dh)
    return o.permute(0, 3, 1, 2, 4).reshape(Bsz, K, Hq, Dh).to(q.dtype)


# ---- 3. the commit without a host sync --------------------------------------------------------------
def commit_rows(ssm_state: Tensor, conv_state: Tensor, ssm_stash: Tensor, conv_stash: Tensor, slot_ids: Tensor,
                 na: Tensor, active: Tensor) -> None:
    """commit_state_ref's contract with the rows that move chosen on the device: every row of the batch is
    written, those that keep their state with their own values (a padded batch's repeated rows write alike)."""
    L, Bsz, K = ssm_stash.shape[:3]
    C, Wm1 = conv_state.shape[2], conv_state.shape[3]
    take = active & (na < K - 1)  # (B,)
    n = na.clamp(0, K - 1)
    ssm = ssm_stash[:, torch.arange(Bsz, device=na.device), n]  # (L, B, H, P, N): the state after row na
    ssm_state[:, slot_ids] = torch.where(take[None, :, None, None, None], ssm, ssm_state[:, slot_ids])
    cols = n[:, None] + 1 + torch.arange(Wm1, device=na.device)  # (B, W-1): the window after row na
    conv = conv_stash.gather(-1, cols[None, :, None, :].expand(L, -1, C, -1))  # (L, B, C, W-1)
    conv_state[:, slot_ids] = torch.where(take[None, :, None, None], conv, conv_state[:, slot_ids])


commit_state = library_op("commit_state(Tensor(a!) ssm_state, Tensor(b!) conv_state, Tensor ssm_stash, "
                          "Tensor conv_stash, Tensor slot_ids, Tensor na, Tensor active) -> ()")(commit_rows)


# ---- 4. the ops table of a graph -----------------------------------------------------------------------
def use_graph_ops(ops, compiled: bool):
    """ops (an Ops) as a graph runs them: the sync-free commit on the torch backend (the Triton one has none),
    and under torch.compile the verify's cache-writing ops as written for inductor (above)."""
    if ops.backend == "torch":
        ops.commit_state = commit_state if compiled else commit_rows
    if compiled:
        if ops.backend != "torch":
            raise ValueError("compile: torch.compile needs backend='torch' (the Triton kernels are not wrapped for it)")
        ops.mamba_verify, ops.attention_verify = mamba_verify, attention_verify
