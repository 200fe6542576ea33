"""The compiled step (docs/DESIGN.md §12): the engine's hot calls through torch.compile, one static graph per bucket.

Compiled: the target's verify (here), the MTP head's draft step and catch-up and the DFlash block forward
(their drafters' compile()), and on CUDA the accept rule. A bucket is (Bp, K, kv): the batch padded up to
a power of two (at most the slot count), K as the call asks, and the KV rows attention reads, the longest
sequence after the call rounded up to a power of two (at least KV_MIN, at most the cache's length).
Padding rows repeat row 0 (same ids, slot and length), so they compute and write exactly what row 0 does
and no other slot is touched.

The Mamba and attention math runs in the graph, where inductor fuses it; only the cache writes leave it,
as two opaque custom ops with their writes declared (`mamba_write`, `kv_write`), so the graph hands them
the cache views and they write in place. Traced instead, a write into a slice of a cache buffer becomes a
copy of the whole buffer and a copy back, every call. The cache buffers are static addresses and a graph
has no host sync (fullgraph), so on CUDA every graph is captured as a CUDA graph ("reduce-overhead").
"""
import time

import torch
from torch import Tensor

from nano_spec.model.cache import HybridCache
from nano_spec.model.sampling import accept_rule
from nano_spec_kernels.common import apply_rope_ref, conv_silu_ref, mamba_dt_ref, split_xbc


# ---- 1. Mamba: the K-row recurrence in the graph, the writes in one op ------------------------------
@torch.library.custom_op("nano_spec::mamba_write", mutates_args=("conv_state", "ssm_state", "conv_stash", "ssm_stash"))
def mamba_write(conv_state: Tensor, ssm_state: Tensor, conv_stash: Tensor, ssm_stash: Tensor, slot_ids: Tensor,
                window: Tensor, states: Tensor) -> None:
    """window (B, C, W-1+K) and states (B, K, H, P, N) into the stashes; the live state and conv window of
    slots slot_ids advance to the last row."""
    conv_stash.copy_(window)
    ssm_stash.copy_(states)
    ssm_state[slot_ids] = states[:, -1]
    conv_state[slot_ids] = window[:, :, window.shape[2] - conv_state.shape[2]:]


mamba_write.register_fake(lambda *args: None)  # writes only: nothing to trace


def mamba_verify(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D,
                 ssm_stash, conv_stash, n_groups: int, dt_limit=(0.0, float("inf"))):
    """mamba_verify_ref's contract, written for inductor: the recurrence unrolled over the K rows as
    elementwise ops on (B, H, P, N), which it fuses into one loop nest per row."""
    Bsz, K, _ = xBC.shape
    H, P = ssm_state.shape[1], ssm_state.shape[2]
    window = torch.cat([conv_state[slot_ids], xBC.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # (B, C, W-1+K)
    x, Bg, Cg = split_xbc(conv_silu_ref(window, conv_weight, conv_bias), H, P, n_groups)  # (B, K, ...)
    dt = mamba_dt_ref(dt, dt_bias, dt_limit)  # (B, K, H)
    decay = torch.exp(dt * -torch.exp(A_log.float()))  # (B, K, H)
    xf = x.float()
    Bh = Bg.float().repeat_interleave(H // n_groups, dim=2)[:, :, :, None, :]  # (B, K, H, 1, N): group g's B
    Ch = Cg.float().repeat_interleave(H // n_groups, dim=2)[:, :, :, None, :]
    state, rows = ssm_state[slot_ids], []  # (B, H, P, N) fp32
    for j in range(K):  # S_j = exp(dt_j A) S_{j-1} + dt_j x_j ⊗ B_j
        state = decay[:, j, :, None, None] * state + (dt[:, j, :, None] * xf[:, j])[..., None] * Bh[:, j]
        rows.append(state)
    states = torch.stack(rows, dim=1)  # (B, K, H, P, N)
    y = (states * Ch).sum(-1) + D.float()[:, None] * xf  # y_j = S_j C_j + D x_j
    mamba_write(conv_state, ssm_state, conv_stash, ssm_stash, slot_ids, window, states)
    return y.to(xBC.dtype)


# ---- 2. attention: the K new rows written in one op, then attention over the slot's rows ------------
@torch.library.custom_op("nano_spec::kv_write", mutates_args=("k_cache", "v_cache"))
def kv_write(k_cache: Tensor, v_cache: Tensor, slot_ids: Tensor, pos: Tensor, k: Tensor, v: Tensor) -> None:
    """Rows k, v (B, K, Hkv, Dh) into the caches (S, L, Hkv, Dh) at slots slot_ids (B,), positions pos (B, K)."""
    k_cache[slot_ids[:, None], pos] = k
    v_cache[slot_ids[:, None], pos] = v


kv_write.register_fake(lambda *args: None)


def attention_verify(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale: float, rope_theta=None):
    """attention_verify_ref's contract, written for inductor. The rows are written first and then read back
    with the rest: reading the cache before a write of it would make inductor keep a copy of the old cache."""
    Bsz, K, Hq, Dh = q.shape
    L, Hkv = k_cache.shape[1], k.shape[2]
    pos = seq_lens[:, None] + torch.arange(K, device=q.device)  # (B, K)
    kv_write(k_cache, v_cache, slot_ids, pos, apply_rope_ref(k, pos, rope_theta), v)  # k is cached rotated
    qg = apply_rope_ref(q, pos, rope_theta).float().view(Bsz, K, Hkv, Hq // Hkv, Dh)  # grouped by KV head
    s = torch.einsum("bqhrd,bkhd->bhrqk", qg, k_cache[slot_ids].float()) * scale  # (B, Hkv, rep, K, L)
    visible = torch.arange(L, device=q.device)[None, None, :] <= pos[:, :, None]  # (B, K, L)
    s = s.masked_fill(~visible[:, None, None], float("-inf"))
    o = torch.einsum("bhrqk,bkhd->bqhrd", s.softmax(-1), v_cache[slot_ids].float())
    return o.reshape(Bsz, K, Hq, Dh).to(q.dtype)


# ---- 3. buckets ---------------------------------------------------------------------------------------
KV_MIN = 256  # the smallest KV bucket: each bucket is one more graph to compile, and a short one saves little
RECOMPILE_LIMIT = 4096  # graphs of one function over all engines of a process (an engine at max_batch 8, γ 4 and
                        # 4,096 KV rows has 4 x 5 x 5 = 100 verify buckets)


def bucket(n: int, least: int, most: int) -> int:
    """n rounded up to a power of two, within [least, most]."""
    return min(max(1 << (n - 1).bit_length(), least), most)


def buckets(least: int, most: int) -> set:
    """Every bucket of n in [1, most]."""
    return {bucket(n, least, most) for n in range(1, most + 1)}


def compile_fn(fn, device, dynamic: bool | None):
    """torch.compile of fn with nano_spec's settings. The weights are fixed for an engine's life, so the guards skip
    the modules' attributes: checking every parameter on each call cost ~0.3 ms. Inductor keeps a fused chain of
    bf16 ops in fp32 unless told to round after each op as eager does; without that, bf16 compiled logits drift
    from eager's and greedy tokens part within a few dozen (fp32 is unaffected)."""
    mode = "reduce-overhead" if torch.device(device).type == "cuda" else None
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "emulate_precision_casts": True}
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, mode=mode, options=options)


class Timed:
    """seconds: the time of the calls that compiled a graph (the first call with each key).

    On CUDA every call starts a new step of the CUDA graphs, after which an earlier replay's outputs may
    be overwritten; so the outputs are copied out of the graphs' memory (a few small tensors a call)."""

    def __init__(self, device, label: str, most: int | None = None):
        self.seconds, self.seen, self.cuda = 0.0, set(), torch.device(device).type == "cuda"
        # listener(label, n, most, threads), if set, hears of each graph before it compiles: the call, its nth graph
        # at this thread count, the most graphs its buckets allow (None: no bound), and the thread count
        self.label, self.most, self.listener = label, most, None
        # dynamo's settings for these calls only, not the process's: every bucket of every engine is one more
        # entry of fn's code object, and a hit limit is an error rather than a silent fall back to eager
        self.scope = torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True)

    def timed(self, key, fn, *args):
        # inductor's CPU code is made for one thread count: another count compiles the graph again, so it is part
        # of the key (a graph compiled at 2 threads is a compile, announced, timed and kept from the planner)
        threads = torch.get_num_threads()
        key = (threads, key)
        if self.cuda:
            torch.compiler.cudagraph_mark_step_begin()
        new = key not in self.seen
        with self.scope:  # ~10 us a call
            if new and self.listener is not None:
                self.listener(self.label, 1 + sum(t == threads for t, _ in self.seen), self.most, threads)
            t0 = time.perf_counter()
            out = fn(*args)  # a new key compiles the graph, or loads it from the on-disk cache
        if new:
            self.seen.add(key)
            self.seconds += time.perf_counter() - t0
        return each(out, Tensor.clone) if self.cuda else out


def each(out, f):
    """f applied to a call's output: one tensor, or every tensor of a tuple."""
    return f(out) if isinstance(out, Tensor) else tuple(f(o) for o in out)


def static_buffers(*tensors):
    """Buffers a compiled call reads or writes at a fixed address: passed as they are, never copied (and on
    CUDA, what a captured graph may keep)."""
    for t in tensors:
        torch._dynamo.mark_static_address(t)


class Bucketed(Timed):
    """fn compiled once per bucket: fn(*batched, *rest, kv_len) -> (outputs cut to B, Bp).

    The first `batched` arguments carry the batch in dim 0 and are padded to Bp by repeating row 0; kv_len is
    rounded up to its bucket. Every tensor in the output (a tensor or a tuple of them) is cut back to B rows;
    what fn writes into buffers is written at Bp rows (the padding rows write what row 0 writes)."""

    def __init__(self, fn, batched: int, num_slots: int, kv_max: int, max_k: int, device, label: str):
        super().__init__(device, label, len(buckets(1, num_slots)) * max_k * len(buckets(min(KV_MIN, kv_max), kv_max)))
        self.batched, self.num_slots, self.kv_max = batched, num_slots, kv_max
        self.fn = compile_fn(fn, device, dynamic=False)

    def __call__(self, *args, kv_len: int) -> tuple:
        """kv_len: the longest sequence's length after the call, from host values."""
        B = args[0].shape[0]
        Bp, kv = bucket(B, 1, self.num_slots), bucket(kv_len, min(KV_MIN, self.kv_max), self.kv_max)
        if Bp > B:
            args = [torch.cat([t, t[:1].expand(Bp - B, *t.shape[1:])]) for t in args[: self.batched]] + \
                list(args[self.batched:])
        key = (kv, *(tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in args))
        out = self.timed(key, self.fn, *args, kv)
        return each(out, lambda t: t[:B]), Bp


# ---- 4. entry points ----------------------------------------------------------------------------------
def compiled_verify(model, cache: HybridCache) -> Bucketed:
    """verify(ids, slot_ids, seq_lens, cache, kv_len=) -> (logits (B, K, V), Bp): model.verify per bucket.
    The stashes are written at the padded shape: the caller reads them as cache.<stash>(Bp, K)[..., :B, ...]."""
    use_compiled_ops(model)
    static_buffers(cache.k, cache.v, cache.conv_state, cache.ssm_state, cache._ssm_stash, cache._conv_stash,
                   cache._hidden_stash, cache._tap_stash)
    return Bucketed(model.verify, 3, cache.num_slots, cache.k.shape[2], cache.max_k, cache.k.device, "verify")


def use_compiled_ops(model):
    """The model's cache-writing ops as written for inductor (above); the rest keep the torch references."""
    if model.ops.backend != "torch":
        raise ValueError("compile: needs backend='torch' (the Triton kernels are not wrapped for compile)")
    model.ops.mamba_verify, model.ops.attention_verify = mamba_verify, attention_verify


class CompiledAcceptRule(Timed):
    """sampling.accept_rule compiled. It writes nothing, so its batch is not padded: a shape it has not seen
    recompiles it once as a graph over any batch and K."""

    def __init__(self, device):
        super().__init__(device, "accept rule")
        self.fn = compile_fn(accept_rule, device, dynamic=None)

    def __call__(self, ops, logits, drafts, nd, sampling, q=None, uniforms=None, bitmask=None):
        key = (logits.shape, sampling.all_greedy, q is None, bitmask is None)
        return self.timed(key, self.fn, ops, logits, drafts, nd, sampling, q, uniforms, bitmask)
