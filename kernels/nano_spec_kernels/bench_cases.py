"""The kernel bench's cases (python -m nano_spec_kernels.bench): for every kernel of this package, the sizes it is
swept over at a model's shape, the inputs of one call, the bytes the call must move (the `<op>_bytes` formula
beside the kernel, which the roofline uses too), its flops where they matter (the prefill kernels), and the
implementations timed on those inputs: the torch reference ("ref", first), the Triton launcher ("triton ...") and
the well-known kernels for the same job (bench_baselines.py).

The model shapes are plain dimensions, copied from weights/stdlib-hybrid-8m/config.json (the shipped model) and
scripts/model_shapes.py (Granite 4.0-H 350m and 1b): this package imports nothing from nano_spec. The sizes are a
decode step's, B sequences of K rows (K = 1 plain decode, K = 4 a γ = 3 verify) over ctx cache rows, and a prompt's
T tokens for the prefill kernels.
"""
from functools import partial
from typing import Callable, NamedTuple

import torch

from nano_spec_kernels.attention_prefill import attention_prefill, attention_prefill_bytes, attention_prefill_ref
from nano_spec_kernels.attention_verify import (attention_block, attention_block_ref, attention_verify,
                                               attention_verify_bytes, attention_verify_ref, verify_meta)
from nano_spec_kernels.bench_baselines import (Call, flash_attn_prefill, flash_attn_verify, flashinfer_decode,
                                               mamba_ssm_scan, mamba_ssm_verify)
from nano_spec_kernels.commit_state import commit_state, commit_state_bytes, commit_state_ref
from nano_spec_kernels.common import split_plan
from nano_spec_kernels.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_bytes, gated_rmsnorm_ref
from nano_spec_kernels.gather_rows import gather_rows, gather_rows_bytes, gather_rows_ref
from nano_spec_kernels.mamba_scan import mamba_scan, mamba_scan_bytes, mamba_scan_ref
from nano_spec_kernels.mamba_verify import mamba_verify, mamba_verify_bytes, mamba_verify_ref
from nano_spec_kernels.rmsnorm import rmsnorm, rmsnorm_bytes, rmsnorm_ref
from nano_spec_kernels.verdict_greedy import row_stats_meta, verdict_greedy, verdict_greedy_bytes, verdict_greedy_ref
from nano_spec_kernels.verdict_sample import verdict_sample, verdict_sample_bytes, verdict_sample_ref


class Shape(NamedTuple):
    """A model's dimensions (docs/DESIGN.md §1): hidden D, vocabulary V; Mamba2 heads H of P dims, state N, groups G,
    conv width W, Lm Mamba layers; attention heads Hq over Hkv KV heads of Dh; Kb rows a block drafter proposes."""
    D: int
    V: int
    H: int
    P: int
    N: int
    G: int
    W: int
    Lm: int
    Hq: int
    Hkv: int
    Dh: int
    Kb: int

    @property
    def C(self) -> int:  # conv channels: x, then B_g and C_g of every group
        return self.H * self.P + 2 * self.G * self.N


MODELS = {
    "shipped": Shape(D=256, V=4096, H=8, P=64, N=64, G=1, W=4, Lm=4, Hq=4, Hkv=2, Dh=64, Kb=8),
    "350m": Shape(D=768, V=100352, H=48, P=32, N=128, G=1, W=4, Lm=28, Hq=12, Hkv=4, Dh=64, Kb=16),
    "1b": Shape(D=1536, V=100352, H=48, P=64, N=128, G=1, W=4, Lm=36, Hq=12, Hkv=4, Dh=128, Kb=16),
}
TINY = Shape(D=64, V=512, H=2, P=16, N=16, G=1, W=4, Lm=2, Hq=4, Hkv=2, Dh=16, Kb=4)  # --quick: the interpreter's size
ROPE_THETA = 10000.0  # the block drafter's RoPE (weights/stdlib-hybrid-8m/dflash/config.json); the targets are NoPE
EPS, RESIDUAL_MULTIPLIER = 1e-5, 0.246  # Granite 4.0-H's rms_norm_eps and residual_multiplier


class Env(NamedTuple):
    """Where the cases run: the device, whether it is CUDA (the launchers' plans depend on it) and its SM count."""
    device: torch.device
    cuda: bool
    n_sm: int


class Setup(NamedTuple):
    """One case ready to time: implementation name -> Call ("ref" first), the bytes one call must move, its flops
    (0 where they do not matter) and notes on the implementations left out."""
    calls: dict
    nbytes: int
    flops: int = 0
    notes: tuple = ()


class Kernel(NamedTuple):
    """A kernel's sweep: full(shape) and tiny(shape) -> {size name: values} (the full sweep, and --quick's),
    build(shape, size, dtype, env) -> Setup; no_compile: why the reference is not timed under torch.compile."""
    full: Callable
    tiny: Callable
    build: Callable
    no_compile: str = ""

    def sizes(self, shape: Shape, quick: bool) -> list:
        """The sweep at shape: every combination of the values, the first name varying slowest -> [{name: value}]."""
        out = [{}]
        for name, values in (self.tiny if quick else self.full)(shape).items():
            out = [dict(d, **{name: v}) for d in out for v in values]
        return out


def _setup(ref: Call, triton: dict, baselines: dict, nbytes: int, flops: int = 0) -> Setup:
    """A Setup from the reference, the Triton calls and the baselines' makers' results (a Call, or a note)."""
    calls = {"ref": ref, **triton, **{k: v for k, v in baselines.items() if isinstance(v, Call)}}
    return Setup(calls, nbytes, flops, tuple(v for v in baselines.values() if isinstance(v, str)))


def _randn(env: Env, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=env.device, dtype=torch.float32).mul_(scale).to(dtype)


def _mamba_layer(s: Shape, dt: torch.dtype, env: Env) -> tuple:
    """conv_weight (C, W), conv_bias (C,), dt_bias, A_log, D (H,) in the activation dtype, as a loaded model holds
    them, in realistic ranges (A in [-16, -1], dt around 0.01 .. 1)."""
    rand = partial(torch.rand, device=env.device)
    return (_randn(env, s.C, s.W, dtype=dt, scale=s.W ** -0.5), _randn(env, s.C, dtype=dt, scale=0.1),
            (rand(s.H) * 4 - 3).to(dt), torch.log(rand(s.H) * 15 + 1).to(dt), _randn(env, s.H, dtype=dt))


# ---------------------------------------------------------------- Mamba

def _mamba_verify(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    B, K = size["B"], size["K"]
    xBC, dts = _randn(env, B, K, s.C, dtype=dt), _randn(env, B, K, s.H, dtype=dt)  # (B, K, C), (B, K, H)
    conv_state = _randn(env, B, s.C, s.W - 1, dtype=dt)  # (S, C, W-1): one slot per sequence
    ssm_state = _randn(env, B, s.H, s.P, s.N, scale=0.1)  # (S, H, P, N) fp32
    slots = torch.randperm(B, device=env.device)  # out of order, as the engine's slots
    stashes = (torch.empty(B, K, s.H, s.P, s.N, device=env.device), torch.empty(B, s.C, s.W - 1 + K, device=env.device,
                                                                                dtype=dt))
    prm = _mamba_layer(s, dt, env)
    args = (xBC, dts, conv_state, ssm_state, slots, *prm, *stashes, s.G)
    return _setup(Call(mamba_verify_ref, args), {"triton": Call(mamba_verify, args)},
                  {"mamba_ssm": mamba_ssm_verify(xBC, dts, conv_state, ssm_state, *prm, *stashes, s.G)},
                  sum(mamba_verify_bytes(B, K, s.H, s.P, s.N, s.G, s.W, dt.itemsize).values()))


def _commit_state(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    L, B, K = size["L"], size["B"], size["K"]
    ssm_state, conv_state = _randn(env, L, B, s.H, s.P, s.N), _randn(env, L, B, s.C, s.W - 1, dtype=dt)
    ssm_stash = _randn(env, L, B, K, s.H, s.P, s.N)  # (L, B, K, H, P, N) fp32
    conv_stash = _randn(env, L, B, s.C, s.W - 1 + K, dtype=dt)
    slots = torch.randperm(B, device=env.device)
    na = torch.randint(0, K - 1, (B,), device=env.device)  # every row rejects a draft and commits: the worst case
    active = torch.ones(B, dtype=torch.bool, device=env.device)
    args = (ssm_state, conv_state, ssm_stash, conv_stash, slots, na, active)
    # the reference finds the committing rows with nonzero(), which waits on the device: no CUDA graph
    return _setup(Call(commit_state_ref, args, graph=False), {"triton": Call(commit_state, args)}, {},
                  sum(commit_state_bytes(L, B, K, s.H, s.P, s.N, s.C, s.W, dt.itemsize).values()))


def _scan_flops(T: int, s: Shape) -> int:
    """The recurrence's flops: per token and state element 3 for S = exp(dt A) S + (dt x) B^T (two multiplies, an
    add) and 2 for y = S C; per channel 2 a conv tap. The chunked form does more; these are the useful ones."""
    return T * (5 * s.H * s.P * s.N + 2 * s.C * s.W)


def _mamba_scan(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    T = size["T"]
    xBC, dts = _randn(env, T, s.C, dtype=dt), _randn(env, T, s.H, dtype=dt)  # (T, C), (T, H)
    args = (xBC, dts, *_mamba_layer(s, dt, env), s.G, s.P)
    triton = {f"triton {m}": Call(partial(mamba_scan, method=m), args) for m in ("chunked", "recurrent")}
    return _setup(Call(mamba_scan_ref, args), triton, {"mamba_ssm": mamba_ssm_scan(*args)},
                  sum(mamba_scan_bytes(T, s.H, s.P, s.N, s.G, s.W, dt.itemsize).values()), _scan_flops(T, s))


# ---------------------------------------------------------------- attention

def _attention_inputs(s: Shape, B: int, R: int, L: int, dt: torch.dtype, env: Env) -> tuple:
    """q (B, R, Hq, Dh), k, v (B, R, Hkv, Dh) of R new rows per sequence; caches (S, L, Hkv, Dh), S = B slots."""
    return (_randn(env, B, R, s.Hq, s.Dh, dtype=dt), _randn(env, B, R, s.Hkv, s.Dh, dtype=dt),
            _randn(env, B, R, s.Hkv, s.Dh, dtype=dt), _randn(env, B, L, s.Hkv, s.Dh, dtype=dt),
            _randn(env, B, L, s.Hkv, s.Dh, dtype=dt))


def _attention_verify(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    ctx, B, K = size["ctx"], size["B"], size["K"]
    L = ctx + K  # the runner's cache view: the old rows and the K it appends
    slots, lens = torch.randperm(B, device=env.device), torch.full((B,), ctx, device=env.device)
    args = (*_attention_inputs(s, B, K, L, dt, env), slots, lens, s.Dh ** -0.5, None)
    splits = split_plan(L, verify_meta(s.Hq, s.Hkv, s.Dh, K, dt, env.cuda)["BLOCK_N"], B * s.Hkv, env.n_sm)[1]
    return _setup(Call(attention_verify_ref, args), {"triton": Call(attention_verify, args)},
                  {"flash_attn": flash_attn_verify(*args), "flashinfer": flashinfer_decode(*args)},
                  sum(attention_verify_bytes(B, K, s.Hq, s.Hkv, s.Dh, ctx, dt.itemsize, splits).values()))


def _attention_block(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    ctx, B, Kb = size["ctx"], size["B"], size["Kb"]
    L = ctx + Kb  # ctx rows read; Kb spare rows, where flash-attn appends the block (ours reads none of them)
    slots, lens = torch.randperm(B, device=env.device), torch.full((B,), ctx, device=env.device)
    args = (*_attention_inputs(s, B, Kb, L, dt, env), slots, lens, s.Dh ** -0.5, ROPE_THETA)
    splits = split_plan(L, verify_meta(s.Hq, s.Hkv, s.Dh, Kb, dt, env.cuda)["BLOCK_N"], B * s.Hkv, env.n_sm)[1]
    # attention_verify's launches without the cache write: the block's K/V rows stay in registers
    nbytes = attention_verify_bytes(B, Kb, s.Hq, s.Hkv, s.Dh, ctx, dt.itemsize, splits, rope=True)
    del nbytes["cache rows written"]
    return _setup(Call(attention_block_ref, args), {"triton": Call(attention_block, args)},
                  {"flash_attn": flash_attn_verify(*args, causal=False)}, sum(nbytes.values()))


def _attention_prefill(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    T = size["T"]
    q, k, v = (_randn(env, T, h, s.Dh, dtype=dt) for h in (s.Hq, s.Hkv, s.Hkv))  # (T, Hq|Hkv, Dh)
    k_cache, v_cache = (_randn(env, 1, T, s.Hkv, s.Dh, dtype=dt) for _ in range(2))  # one slot of T rows
    args = (q, k, v, k_cache, v_cache, 0, s.Dh ** -0.5, None)
    flops = 4 * s.Hq * s.Dh * T * (T + 1) // 2  # q.k and p.v, 2 * Dh each, over the T(T+1)/2 causal pairs per head
    return _setup(Call(attention_prefill_ref, args), {"triton": Call(attention_prefill, args)},
                  {"flash_attn": flash_attn_prefill(*args)},
                  sum(attention_prefill_bytes(T, s.Hq, s.Hkv, s.Dh, dt.itemsize).values()), flops)


# ---------------------------------------------------------------- verdicts, norms, gather

def _verdict_greedy(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    V, B, K = size["V"], size["B"], size["K"]
    logits = _randn(env, B, K, V, dtype=dt)
    drafts, nd = torch.randint(0, V, (B, K - 1), device=env.device), torch.full((B,), K - 1, device=env.device)
    args = (logits, drafts, nd)
    splits = split_plan(V, row_stats_meta(V, env.cuda)["BLOCK_V"], B * K, env.n_sm)[1]
    return _setup(Call(verdict_greedy_ref, args), {"triton": Call(verdict_greedy, args)}, {},
                  sum(verdict_greedy_bytes(B, K, V, dt.itemsize, splits).values()))


def _verdict_sample(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    V, B, K = size["V"], size["B"], size["K"]
    dev = env.device
    logits = _randn(env, B, K, V, dtype=dt)
    q = _randn(env, B, K - 1, V).softmax(-1)  # the draft probabilities, fp32 as sampling makes them
    drafts, nd = torch.randint(0, V, (B, K - 1), device=dev), torch.full((B,), K - 1, device=dev)
    settings = (torch.full((B,), 0.8, device=dev), torch.full((B,), 50, device=dev), torch.full((B,), 0.95, device=dev))
    args = (logits, q, drafts, nd, torch.rand(B, K, device=dev), *settings)  # temperature, top_k, top_p
    return _setup(Call(verdict_sample_ref, args), {"triton": Call(verdict_sample, args)}, {},
                  sum(verdict_sample_bytes(B, K, V, dt.itemsize).values()))


def _gather_rows(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    B, K, D = size["B"], size["K"], size["D"]
    args = (_randn(env, B, K, D, dtype=dt), torch.randint(0, K, (B,), device=env.device))  # src (B, K, D), idx (B,)
    return _setup(Call(gather_rows_ref, args), {"triton": Call(gather_rows, args)}, {},
                  sum(gather_rows_bytes(B, D, dt.itemsize).values()))


def _rmsnorm(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    rows, D = size["rows"], size["D"]
    x, res = _randn(env, rows, D, dtype=dt), _randn(env, rows, D, dtype=dt)  # (rows, D): a step's B * K rows
    args = (x, _randn(env, D, dtype=dt), EPS, res, RESIDUAL_MULTIPLIER)  # the fused residual add, as the layers call it
    return _setup(Call(rmsnorm_ref, args), {"triton": Call(rmsnorm, args)}, {},
                  sum(rmsnorm_bytes(rows, D, dt.itemsize, True).values()))


def _gated_rmsnorm(s: Shape, size: dict, dt: torch.dtype, env: Env) -> Setup:
    rows, d_in = size["rows"], size["d_in"]
    y, z = _randn(env, rows, d_in, dtype=dt), _randn(env, rows, d_in, dtype=dt)  # (rows, d_in)
    args = (y, z, _randn(env, d_in, dtype=dt), d_in // s.G, EPS)  # one norm group per Mamba group
    return _setup(Call(gated_rmsnorm_ref, args), {"triton": Call(gated_rmsnorm, args)}, {},
                  sum(gated_rmsnorm_bytes(rows, d_in, dt.itemsize).values()))


# ---------------------------------------------------------------- the sweeps

BATCH, NORM_ROWS = (1, 8, 64), (1, 4, 32, 256)  # decode batches; a step's B * K rows
KERNELS = {  # name: Kernel(the full sweep, --quick's, build[, why no torch.compile]); the decode step's first
    "mamba_verify": Kernel(lambda s: dict(K=(1, 4), B=(1, 8, 32, 64, 256)), lambda s: dict(K=(2,), B=(1, 2)),
                           _mamba_verify),
    "attention_verify": Kernel(lambda s: dict(ctx=(1024, 8192), K=(1, 4), B=BATCH),
                               lambda s: dict(ctx=(32,), K=(2,), B=(1, 2)), _attention_verify),
    "commit_state": Kernel(lambda s: dict(L=(s.Lm,), K=(4,), B=(1, 8, 32)), lambda s: dict(L=(s.Lm,), K=(2,), B=(1, 2)),
                           _commit_state),
    "verdict_greedy": Kernel(lambda s: dict(V=(s.V,), K=(1, 4), B=BATCH), lambda s: dict(V=(s.V,), K=(2,), B=(1, 2)),
                             _verdict_greedy),
    "verdict_sample": Kernel(lambda s: dict(V=(s.V,), K=(1, 4), B=BATCH), lambda s: dict(V=(s.V,), K=(2,), B=(1, 2)),
                             _verdict_sample),
    "attention_block": Kernel(lambda s: dict(ctx=(1024, 8192), Kb=(s.Kb,), B=BATCH),
                              lambda s: dict(ctx=(32,), Kb=(s.Kb,), B=(1, 2)), _attention_block),
    "gather_rows": Kernel(lambda s: dict(D=(s.D,), K=(4,), B=BATCH), lambda s: dict(D=(s.D,), K=(2,), B=(1, 2)),
                          _gather_rows),
    "rmsnorm": Kernel(lambda s: dict(D=(s.D,), rows=NORM_ROWS), lambda s: dict(D=(s.D,), rows=(1, 4)), _rmsnorm),
    "gated_rmsnorm": Kernel(lambda s: dict(d_in=(s.H * s.P,), rows=NORM_ROWS),
                            lambda s: dict(d_in=(s.H * s.P,), rows=(1, 4)), _gated_rmsnorm),
    "mamba_scan": Kernel(lambda s: dict(T=(128, 512, 2048)), lambda s: dict(T=(16, 32)), _mamba_scan,
                         "the reference loops over the T tokens in Python, which torch.compile would unroll"),
    "attention_prefill": Kernel(lambda s: dict(T=(256, 1024, 4096)), lambda s: dict(T=(16, 32)), _attention_prefill),
}
