"""The compiled verify (docs/DESIGN.md §12): HybridLM.verify through torch.compile, one static graph per bucket.

A bucket is (Bp, K, kv): the batch padded up to a power of two (at most the slot count), K as the step asks,
and the KV rows attention reads, max(seq_lens) + K rounded up to a power of two (at least KV_MIN, at most the
cache's length); reading every cache row instead would cost more than all the rest of a short verify.
Padding rows repeat row 0 (same ids, slot and length), so they compute and write exactly what row 0 does
and no other slot is touched.

The two ops that write the caches run as opaque custom ops with their writes declared, so the graph passes
the cache views to them and they write in place:
  - the Mamba verify: inductor would turn its K-row state update into scalar C++ loops, slower than the
    reference's batched tensor ops;
  - the attention verify: its row writes into a view of the KV cache, traced, become a copy of the whole
    cache (every layer and slot) and a copy back, each step.
Everything else (the linears, norms and glue) is left to inductor. The cache buffers are static addresses
and the graph has no host sync (fullgraph, dynamic=False).
"""
import torch
from torch import Tensor

from nano_spec.cache import HybridCache
from nano_spec_kernels.attention_verify import attention_verify_ref
from nano_spec_kernels.mamba_verify import mamba_verify_ref


@torch.library.custom_op("nano_spec::mamba_verify", mutates_args=("conv_state", "ssm_state", "ssm_stash", "conv_stash"))
def _mamba_verify_op(xBC: Tensor, dt: Tensor, conv_state: Tensor, ssm_state: Tensor, slot_ids: Tensor,
                     conv_weight: Tensor, conv_bias: Tensor | None, dt_bias: Tensor, A_log: Tensor, D: Tensor,
                     ssm_stash: Tensor, conv_stash: Tensor, n_groups: int, dt_lo: float, dt_hi: float) -> Tensor:
    return mamba_verify_ref(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D,
                            ssm_stash, conv_stash, n_groups, (dt_lo, dt_hi))


@_mamba_verify_op.register_fake
def _(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D, ssm_stash, conv_stash,
      n_groups, dt_lo, dt_hi):
    return xBC.new_empty(*xBC.shape[:2], *ssm_state.shape[1:3])  # y (B, K, H, P)


def mamba_verify(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D,
                 ssm_stash, conv_stash, n_groups: int, dt_limit=(0.0, float("inf"))):
    """mamba_verify_ref's contract, as one op inductor does not look into."""
    return _mamba_verify_op(xBC, dt, conv_state, ssm_state, slot_ids, conv_weight, conv_bias, dt_bias, A_log, D,
                            ssm_stash, conv_stash, n_groups, float(dt_limit[0]), float(dt_limit[1]))


KV_MIN = 128  # the smallest KV bucket: fewer, shorter buckets would only add compiles


@torch.library.custom_op("nano_spec::attention_verify", mutates_args=("k_cache", "v_cache"))
def _attention_verify_op(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_ids: Tensor,
                         seq_lens: Tensor, scale: float, rope_theta: float | None) -> Tensor:
    return attention_verify_ref(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale, rope_theta).contiguous()


@_attention_verify_op.register_fake
def _(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale, rope_theta):
    return q.new_empty(q.shape)  # o (B, K, Hq, Dh), contiguous


def attention_verify(q, k, v, k_cache, v_cache, slot_ids, seq_lens, scale: float, rope_theta=None):
    """attention_verify_ref's contract, as one op inductor does not look into."""
    return _attention_verify_op(q, k, v, k_cache, v_cache, slot_ids, seq_lens, float(scale),
                                None if rope_theta is None else float(rope_theta))


def bucket(n: int, least: int, most: int) -> int:
    """n rounded up to a power of two, within [least, most]."""
    return min(max(1 << (n - 1).bit_length(), least), most)


def buckets(least: int, most: int) -> set:
    return {bucket(n, least, most) for n in range(1, most + 1)}


class CompiledVerify:
    """verify(ids, slot_ids, seq_lens, kv_len) -> (logits (B, K, V), Bp): model.verify compiled per bucket.

    The stashes are written at the padded shape: the caller reads them as cache.<stash>(Bp, K)[..., :B, ...]."""

    def __init__(self, model, cache: HybridCache):
        if model.ops.backend != "torch":
            raise ValueError("compile: needs backend='torch' (the Triton kernels are not wrapped for compile)")
        model.ops.mamba_verify, model.ops.attention_verify = mamba_verify, attention_verify
        self.model, self.cache = model, cache
        for t in (cache.k, cache.v, cache.conv_state, cache.ssm_state, cache._ssm_stash, cache._conv_stash,
                  cache._hidden_stash):
            torch._dynamo.mark_static_address(t)
        # every bucket of every engine in the process is one more entry of the one verify's code: room for this
        # engine's, and a hit limit is an error rather than a silent fall back to eager
        L = cache.k.shape[2]
        n = len(buckets(1, cache.num_slots)) * cache.max_k * len(buckets(min(KV_MIN, L), L))
        torch._dynamo.config.recompile_limit += n
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        self.fn = torch.compile(model.verify, fullgraph=True, dynamic=False)

    def __call__(self, ids, slot_ids, seq_lens, kv_len: int) -> tuple:
        """kv_len: max(seq_lens) + K, from host values."""
        B, L = ids.shape[0], self.cache.k.shape[2]
        Bp = bucket(B, 1, self.cache.num_slots)
        if Bp > B:
            pad = lambda t: torch.cat([t, t[:1].expand(Bp - B, *t.shape[1:])])  # noqa: E731
            ids, slot_ids, seq_lens = pad(ids), pad(slot_ids), pad(seq_lens)
        return self.fn(ids, slot_ids, seq_lens, self.cache, bucket(kv_len, min(KV_MIN, L), L))[:B], Bp
