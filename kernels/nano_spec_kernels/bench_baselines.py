"""The well-known kernels beside ours in the kernel bench (python -m nano_spec_kernels.bench), each on the inputs of
our kernel's case and doing the same job:

  mamba_verify       mamba_ssm's selective_state_update after causal_conv1d's causal_conv1d_update, one call of
                     each per row (as Mamba2.step runs them), the stash rows copied out as ours writes them
  mamba_scan         causal_conv1d_fn, then mamba_ssm's chunked scan (mamba_chunk_scan_combined)
  attention_verify   flash-attn's flash_attn_with_kvcache (appends the K new rows, causal); FlashInfer's batch
                     decode at K = 1 (one page per cache slot)
  attention_block    flash_attn_with_kvcache, not causal, RoPE from cos/sin tables (it also appends the block's
                     K/V rows to spare cache rows that ours never reads)
  attention_prefill  flash-attn's flash_attn_func, after the same cache write ours does

Each maker returns a Call, or a note saying why it is skipped (not installed, CUDA only, a dtype it does not take):
the bench prints one line, never a traceback. Ours are called on sequences in their slots; these take sequence b in
slot b (mamba_ssm) or through their own slot index (flash-attn, FlashInfer): the same bytes either way. Their rows
carry our kernel's bytes (the job's), so GB/s compares like with like.
"""
import functools
import importlib.util
from typing import Callable, NamedTuple

import torch


class Call(NamedTuple):
    """One implementation on one case's inputs: fn(*args). graph: whether a CUDA graph can capture it (False when
    it waits on the device, e.g. to count rows, or keeps host-side state between calls)."""
    fn: Callable
    args: tuple = ()
    graph: bool = True

    def __call__(self):
        return self.fn(*self.args)


def _noted(maker):
    """A maker whose own failure (an API another version of the library changed, say) becomes its note."""
    @functools.wraps(maker)
    def make(*args, **kwargs):
        try:
            return maker(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (a baseline must not cost the case its other rows)
            return f"{maker.__name__}: could not be set up, skipped ({type(e).__name__}: {e})"[:240]
    return make


def _why_not(name: str, t: torch.Tensor, modules: tuple, half_only: bool = False) -> str | None:
    """Why baseline `name` cannot run on tensors like t, or None."""
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if absent:
        return f"{name}: not installed ({', '.join(absent)}), skipped"
    if not t.is_cuda:
        return f"{name}: CUDA only, skipped"
    if half_only and t.dtype not in (torch.float16, torch.bfloat16):
        return f"{name}: fp16/bf16 only, skipped at {str(t.dtype).removeprefix('torch.')}"
    return None


def _rotary(theta: float, rows: int, dim: int, like: torch.Tensor) -> dict:
    """flash-attn's rotary tables (rows, dim/2) for rotate-half RoPE, the form of common.apply_rope_ref."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=like.device, dtype=torch.float32) / dim)
    angle = torch.arange(rows, device=like.device, dtype=torch.float32)[:, None] * inv_freq  # (rows, dim/2)
    return dict(rotary_cos=angle.cos().to(like.dtype), rotary_sin=angle.sin().to(like.dtype), rotary_interleaved=False)


@_noted
def mamba_ssm_verify(xBC, dt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, ssm_stash,
                     conv_stash, n_groups: int):
    """mamba_verify's job, shapes as mamba_verify_ref's (S = B slots), row by row."""
    why = _why_not("mamba_ssm", xBC, ("mamba_ssm", "causal_conv1d"))
    if why:
        return why
    from causal_conv1d import causal_conv1d_update
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    Bsz, K, _ = xBC.shape
    _, H, P, N = ssm_state.shape
    G = n_groups
    # Mamba2.step's broadcast: the per-head A, dt_bias and D over the head's P dims (stride 0: one value per head)
    A = (-torch.exp(A_log.float()))[:, None, None].expand(H, P, N)
    dt_bias_hp, D_hp = dt_bias[:, None].expand(H, P), D[:, None].expand(H, P)

    def run():
        conv_stash.copy_(torch.cat([conv_state, xBC.transpose(1, 2)], -1))  # (B, C, W-1+K): what a commit reads
        ys = []
        for j in range(K):
            xbc = causal_conv1d_update(xBC[:, j], conv_state, conv_weight, conv_bias, "silu")  # (B, C); window moves
            x, B_g, C_g = xbc.split([H * P, G * N, G * N], -1)
            ys.append(selective_state_update(ssm_state, x.reshape(Bsz, H, P), dt[:, j, :, None].expand(Bsz, H, P), A,
                                             B_g.reshape(Bsz, G, N), C_g.reshape(Bsz, G, N), D_hp, dt_bias=dt_bias_hp,
                                             dt_softplus=True))  # (B, H, P); the state advances in place
            ssm_stash[:, j].copy_(ssm_state)  # the state after row j, which a commit may need
        return torch.stack(ys, 1)

    return Call(run)


@_noted
def mamba_ssm_scan(xBC, dt, conv_weight, conv_bias, dt_bias, A_log, D, n_groups: int, head_dim: int):
    """mamba_scan's job, shapes as mamba_scan_ref's: one prompt of T tokens from zero state."""
    why = _why_not("mamba_ssm", xBC, ("mamba_ssm", "causal_conv1d"))
    if why:
        return why
    from causal_conv1d import causal_conv1d_fn
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    T, C = xBC.shape
    H, P, G = dt.shape[-1], head_dim, n_groups
    N = (C - H * P) // (2 * G)
    A = -torch.exp(A_log.float())

    def run():
        xbc = causal_conv1d_fn(xBC.t()[None], conv_weight, conv_bias, activation="silu")[0].t()  # (T, C)
        x, B_g, C_g = xbc.split([H * P, G * N, G * N], -1)
        return mamba_chunk_scan_combined(x.reshape(1, T, H, P), dt[None], A, B_g.reshape(1, T, G, N),
                                         C_g.reshape(1, T, G, N), chunk_size=256, D=D, dt_bias=dt_bias,
                                         dt_softplus=True, return_final_states=True)

    return Call(run, graph=False)  # a prefill is not captured in the engine either


@_noted
def flash_attn_verify(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale: float, rope_theta=None, causal=True):
    """attention_verify's job (causal) or attention_block's (not causal: flash-attn also appends the block's K/V, and
    rotates every query row at the block's first position, its rule for a call that is not causal; the same work)."""
    why = _why_not("flash_attn", q, ("flash_attn",), half_only=True)
    if why:
        return why
    from flash_attn import flash_attn_with_kvcache

    rot = _rotary(rope_theta, k_cache.shape[1], q.shape[-1], q) if rope_theta else {}
    lens, slots = seq_lens.to(torch.int32), slot_ids.to(torch.int32)
    return Call(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens,
                                                cache_batch_idx=slots, softmax_scale=scale, causal=causal, **rot))


@_noted
def flash_attn_prefill(q, k, v, k_cache, v_cache, slot: int, scale: float, rope_theta=None):
    """attention_prefill's job: the slot's cache rows written, then causal attention over the prompt."""
    why = _why_not("flash_attn", q, ("flash_attn",), half_only=True)
    if why or rope_theta:
        return why or "flash_attn: the bench's prefill passes no RoPE tables, skipped"
    from flash_attn import flash_attn_func

    T = q.shape[0]

    def run():
        k_cache[slot, :T] = k
        v_cache[slot, :T] = v
        return flash_attn_func(q[None], k[None], v[None], softmax_scale=scale, causal=True)[0]

    return Call(run)


@_noted
def flashinfer_decode(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale: float, rope_theta=None):
    """attention_verify's job at K = 1: the new row appended, then FlashInfer's paged decode over one page per slot."""
    why = _why_not("flashinfer", q, ("flashinfer",), half_only=True)
    if why or rope_theta or q.shape[1] != 1:
        return why or "flashinfer: its decode takes one query row per sequence and no RoPE here, skipped"
    import flashinfer

    Bsz, _, Hq, Dh = q.shape
    L, Hkv = k_cache.shape[1], k_cache.shape[2]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8,
                                                                        device=q.device), "NHD")
    # a page of L rows per cache slot: sequence b's one page is its slot, holding seq_len + 1 rows after the append
    indptr = torch.arange(Bsz + 1, dtype=torch.int32, device=q.device)
    wrapper.plan(indptr, slot_ids.to(torch.int32), (seq_lens + 1).to(torch.int32), Hq, Hkv, Dh, L,
                 pos_encoding_mode="NONE", sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)

    def run():
        k_cache[slot_ids, seq_lens] = k[:, 0]
        v_cache[slot_ids, seq_lens] = v[:, 0]
        return wrapper.run(q[:, 0], (k_cache, v_cache))

    return Call(run, graph=False)  # its plan lives on the host; graphs need the wrapper's CUDA-graph mode
