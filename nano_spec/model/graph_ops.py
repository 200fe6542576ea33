"""The ops a step graph runs in place of the eager ones (docs/DESIGN.md §12); nano_spec/engine/graph.py binds them.

Under torch.compile the Mamba math of a verify around its recurrence runs in the graph, where inductor fuses it;
the cache writes leave it, as opaque operators with their writes declared (cpu_rows' `mamba_write`, `kv_write`,
kernels in C++), so the graph hands them the cache views and they write in place. Traced instead, a write into a
slice of a cache buffer becomes a copy of the whole buffer and a copy back, every call. The attention over the
cache leaves it too (cpu_rows' `attend`, which reads the rows each query sees, not the graph's static KV length).
No graph may hold commit_state_ref, which finds the rows that move with a host sync: a compiled step commits with
cpu_rows' `commit_state`, a CUDA graph of the torch backend with `commit_rows` below. A compiled CPU step's
products of a few rows by a weight are cpu_rows' too (`pack_linears`). A compiled engine's prompts run their Mamba
layers as a graph of their own (engine/graph.py: PromptGraph), which scans in C++ (`mamba_scan`); they attend through
torch's fused attention (`attention_prefill`, eager, as the MTP head's catch-up over a prompt does).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from nano_spec.model.cpu_rows import (attend, attend_block, commit_state, conv_rows, kv_write, library, mamba_scan_rows,
                                      mamba_write)
from nano_spec.model.ssd import last_window
from nano_spec_kernels.common import apply_rope_ref, conv_silu_ref, mamba_dt_ref, split_xbc


# ---- 1. Mamba: the conv and dt in the graph, the K-row recurrence and the writes in one op -----------
def dt_and_decay(dt, dt_bias, A_log, dt_limit):
    """Raw time steps (..., H) -> (dt, the decay a = exp(dt A)) in fp32, A = -exp(A_log): a recurrence's inputs."""
    dt = mamba_dt_ref(dt, dt_bias, dt_limit)
    return dt, torch.exp(dt * -torch.exp(A_log.float()))


def mamba_verify(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D,
                 ssm_stash, conv_stash, n_groups: int, dt_limit=(0.0, float("inf"))):
    """mamba_verify_ref's contract on the CPU, but for the stash's last row, which no commit reads: written only where
    a padded batch repeats a slot (cpu_rows' mamba_write). Inductor fuses the conv, dt and decay; the recurrence is
    C++."""
    H, P = ssm_state.shape[1], ssm_state.shape[2]
    window = torch.cat([conv_state[slot_ids], xBC.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (B, C, W-1+K)
    xbc = conv_silu_ref(window, conv_weight, conv_bias).contiguous()  # (B, K, C) fp32, each row's C values together
    x, Bg, Cg = split_xbc(xbc, H, P, n_groups)  # views: mamba_write reads B and C where they lie
    dt, decay = dt_and_decay(dt, dt_bias, A_log, dt_limit)  # (B, K, H) each
    y = mamba_write(conv_state, ssm_state, conv_stash, ssm_stash, slot_ids, window, decay, dt[..., None] * x, Bg, Cg)
    return (y + D.float()[:, None] * x).to(xBC.dtype)  # y_j = S_j C_j + D x_j


def mamba_scan(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, n_groups: int, head_dim: int,
               dt_limit=(0.0, float("inf"))):
    """mamba_scan_ref's contract for a compiled engine's prompts (a prompt's graph): the conv and the T rows'
    recurrence in C++, each head's state in L1 across the rows, in place of chunked SSD, whose small matmuls and
    (c, H, l, l) decays cost ~10x their arithmetic on a CPU (docs/DESIGN.md §12); dt and the SiLU in the graph."""
    H, taps = dt.shape[-1], conv_weight.t().contiguous().t()  # (C, W), each tap's C values together: conv_rows's read
    xbc = F.silu(conv_rows(xBC, taps, conv_bias), inplace=True)  # (T, C) fp32
    x, Bg, Cg = split_xbc(xbc, H, head_dim, n_groups)  # (T, ...)
    dt, decay = dt_and_decay(dt, dt_bias, A_log, dt_limit)  # (T, H) each
    state = torch.zeros(H, head_dim, Bg.shape[-1], dtype=torch.float32, device=xBC.device)  # (H, P, N)
    y = mamba_scan_rows(state, decay, dt[..., None] * x, Bg, Cg)  # (T, H, P)
    return (y + D.float()[:, None] * x).to(xBC.dtype), state, last_window(xBC, conv_weight.shape[-1])


# ---- 2. attention: the K new rows written, then each row over exactly its slot's visible rows, in C++ ----------
def attention_verify(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale: float, rope_theta=None):
    """attention_verify_ref's contract. The rows are written first and then read back with the rest (cpu_rows'
    kv_write, attend): attend reads the rows 0..pos of each query row's slot, not the cache's L (a KV bucket)."""
    K = q.shape[1]
    pos = seq_lens[:, None] + torch.arange(K, device=q.device)  # (B, K)
    kv_write(k_cache, v_cache, slot_ids, pos, apply_rope_ref(k, pos, rope_theta), v)  # k is cached rotated
    return attend(apply_rope_ref(q, pos, rope_theta).float(), k_cache, v_cache, slot_ids, pos, scale).to(q.dtype)


def attention_prefill(q, k, v, k_cache, v_cache, slot: int, scale: float, rope_theta=None):
    """attention_prefill_ref's contract for a compiled engine's prompts (a prompt's graph; the MTP head's catch-up
    over a prompt, eager): the rows written, then torch's fused causal attention over them (SDPA, whose CPU kernel
    tiles the queries) in place of the reference's (Hq, T, T) scores, about half the time at the shipped shape."""
    T, dtype = q.shape[0], q.dtype
    pos = torch.arange(T, device=q.device)
    k_cache[slot, :T], v_cache[slot, :T] = apply_rope_ref(k, pos, rope_theta), v  # k is cached rotated
    q, k, v = (t.float().transpose(0, 1)[None] for t in (apply_rope_ref(q, pos, rope_theta), k_cache[slot, :T],
                                                          v_cache[slot, :T]))  # (1, H, T, Dh)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1).to(dtype)  # (T, Hq, Dh)


def attention_block(q, k, v, k_cache, v_cache, slot_ids, ctx_lens, scale: float, rope_theta=None):
    """attention_block_ref's contract: each of a block drafter's Kb rows sees its slot's context rows
    0 .. ctx_len - 1 (the caches, only read) and every row of its block (k, v, not cached)."""
    Bsz, Kb = q.shape[:2]
    pos = ctx_lens[:, None] + torch.arange(Kb, device=q.device)  # (B, Kb)
    seen = (ctx_lens - 1)[:, None].expand(Bsz, Kb)  # the last context row each block row sees
    return attend_block(apply_rope_ref(q, pos, rope_theta).float(), k_cache, v_cache, slot_ids, seen, scale,
                        apply_rope_ref(k, pos, rope_theta), v).to(q.dtype)


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


# ---- 4. the ops table of a graph -----------------------------------------------------------------------
def use_graph_ops(ops, compiled: bool):
    """ops (an Ops) as a graph runs them. Under torch.compile: the verify as written for inductor (above), its
    writes, the attention (a verify's and a block drafter's) and the commit cpu_rows' ops, whose C++ kernels are
    built here if need be. In a CUDA graph of the torch backend: the sync-free commit_rows (the Triton backend's
    commit has no sync)."""
    if compiled and ops.backend != "torch":
        raise ValueError("compile: torch.compile needs backend='torch' (the Triton kernels are not wrapped for it)")
    if compiled:
        library()
        ops.mamba_verify, ops.attention_verify, ops.commit_state = mamba_verify, attention_verify, commit_state
        ops.mamba_scan, ops.attention_prefill = mamba_scan, attention_prefill  # a prompt's
        ops.attention_block = attention_block
    elif ops.backend == "torch":
        ops.commit_state = commit_rows
