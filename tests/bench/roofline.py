"""A roofline on paper: the bytes a decode step must move through HBM and the times they imply
(python -m nano_spec_kernels.bench --predict [--model 350m 1b] [--tau 3.07] [--ctx 1024] [--tbs 4.8], which runs
this file as `python -m tests.bench.roofline` from the repository root: it reads the model configs from nano_spec,
which the kernels package never imports).

At decode sizes every kernel and linear is memory bound, so a call takes at least its bytes / HBM bandwidth. The
bytes of a kernel are the formula beside it (`<op>_bytes` in nano_spec_kernels: every tensor element each launch
loads or stores, once); a linear reads its weight once and its input and output activations once; the torch
elementwise ops between them (embedding, the MLP's silu * up, the logits' scaling and finiteness check) are
counted the same way. A GPU run is held to these numbers: measured / predicted is the fraction of peak it reaches
(the kernel bench, python -m nano_spec_kernels.bench, prints that fraction per kernel as % of peak).

The steps, as nano_spec/engine/runner.py runs them, bf16 (the CUDA default) at B sequences, each with ctx cache rows:
  plain    proposer none, γ = 0: verify over K = 1 row, greedy verdict (and the finiteness check of the logits).
  γ = 3    an MTP head of the shipped weights' kind (one attention layer of the model's shape, eh_proj 2D -> D,
           the model's lm_head): 3 drafts (its MLP half at the last accepted row, its logits 3 times, its layer
           twice), verify over K = 4 rows, greedy verdict, commit_state (every row committing: the worst case,
           which the kernel bench times), the head's catch-up over the K rows (its input and its attention half)
           and the head_mid gather.
The Granite 4.0-H checkpoints ship no MTP head; the γ = 3 column prices one. Speedup = tau * t_plain / t_γ3:
tau tokens per γ = 3 step (the acceptance the shipped weights' bench measures) against one per plain step.
Launches are counted too: without CUDA graphs a launch costs a few us of host time, which a B = 1 step of a
small model spends many times over its roofline.
"""
import argparse
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from nano_spec_kernels.attention_verify import attention_verify_bytes, verify_meta
from nano_spec_kernels.commit_state import commit_state_bytes
from nano_spec_kernels.common import split_plan
from nano_spec_kernels.gated_rmsnorm import gated_rmsnorm_bytes
from nano_spec_kernels.gather_rows import gather_rows_bytes
from nano_spec_kernels.mamba_verify import mamba_verify_bytes
from nano_spec_kernels.rmsnorm import rmsnorm_bytes
from nano_spec_kernels.verdict_greedy import row_stats_meta, verdict_greedy_bytes
from nano_spec_kernels.verdict_sample import verdict_sample_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the published shapes
from model_shapes import models  # noqa: E402

N_SM = 132  # H200: the split counts of attention_verify and verdict_greedy
TAU, CTX, TBS = 3.07, 1024, 4.8  # docs/BENCHMARKS.md: tau at γ = 3 on the shipped weights; H200 HBM3e
BATCHES, KS = (1, 8, 32, 64), (1, 4)


class Item(NamedTuple):
    """One op of a step: calls per step, bytes per call, kernel launches per call, whether it is a weight read."""
    name: str
    calls: int
    bytes: int
    launches: int = 1
    kind: str = "kernel"  # kernel | weights | torch


def total(d: dict) -> int:
    return sum(d.values())


def linear(name: str, calls: int, rows: int, n_in: int, n_out: int, act: int) -> list:
    """A bias-free linear: its weight read once (kind weights), its input read and output written (kind torch)."""
    return [Item(name, calls, n_in * n_out * act, 1, "weights"), Item(f"{name} activations", calls,
                                                                       rows * (n_in + n_out) * act, 0, "torch")]


def splits_of(cfg, B: int, K: int, ctx: int) -> int:
    """attention_verify's split count on an H200 for a cache view of ctx + K rows (the runner's kv_len)."""
    meta = verify_meta(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, K, torch.bfloat16, True)
    return split_plan(ctx + K, meta["BLOCK_N"], B * cfg.num_key_value_heads, N_SM)[1]


def attention(cfg, B: int, R: int, ctx: int, act: int, calls: int, name: str = "") -> list:
    """One attention mixer over R rows per sequence: qkv, attention_verify, o_proj."""
    Hq, Hkv, Dh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    splits = splits_of(cfg, B, R, ctx)
    return (linear(f"{name}qkv", calls, B * R, D, (Hq + 2 * Hkv) * Dh, act) +
            [Item(f"{name}attention_verify", calls, total(attention_verify_bytes(B, R, Hq, Hkv, Dh, ctx, act, splits,
                                                                                 cfg.rope is not None)),
                  1 + (splits > 1))] +
            linear(f"{name}o_proj", calls, B * R, Hq * Dh, D, act))


def mlp(cfg, rows: int, act: int, calls: int, name: str = "") -> list:
    """The shared MLP: input_linear (D -> 2I), silu(gate) * up (two torch ops), output_linear."""
    D, I = cfg.hidden_size, cfg.shared_intermediate_size
    return (linear(f"{name}mlp in", calls, rows, D, 2 * I, act) +
            [Item(f"{name}silu * up", calls, 5 * rows * I * act, 2, "torch")] +
            linear(f"{name}mlp out", calls, rows, I, D, act))


def verify_items(cfg, B: int, K: int, ctx: int, act: int = 2) -> list:
    """HybridLM.verify over B x K rows, then the verdict and the step's finiteness check of the logits."""
    rows, D, V = B * K, cfg.hidden_size, cfg.vocab_size
    Lm, La = len(cfg.mamba_layers), len(cfg.attention_layers)
    H, P, N, G, W = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups, cfg.mamba_d_conv
    d_in, C = cfg.d_inner, cfg.conv_dim
    splits = split_plan(V, row_stats_meta(V, True)["BLOCK_V"], rows, N_SM)[1]
    return [
        Item("embedding * multiplier", 1, rows * 8 + 4 * rows * D * act, 2, "torch"),
        Item("rmsnorm", 1, total(rmsnorm_bytes(rows, D, act, False))),
        Item("rmsnorm+residual", 2 * (Lm + La), total(rmsnorm_bytes(rows, D, act, True))),
        *linear("in_proj", Lm, rows, D, d_in + C + H, act),
        Item("mamba_verify", Lm, total(mamba_verify_bytes(B, K, H, P, N, G, W, act, bias=cfg.mamba_conv_bias)), 2),
        Item("gated_rmsnorm", Lm, total(gated_rmsnorm_bytes(rows, d_in, act))),
        *linear("out_proj", Lm, rows, d_in, D, act),
        *attention(cfg, B, K, ctx, act, La),
        *mlp(cfg, rows, act, Lm + La),
        Item("hidden_stash copy", 1, 2 * rows * D * act, 1, "torch"),
        *linear("lm_head", 1, rows, D, V, act),
        Item("logits / logits_scaling", 1, 2 * rows * V * act, 1, "torch"),
        Item("verdict_greedy", 1, total(verdict_greedy_bytes(B, K, V, act, splits)), 2),
        Item("finiteness of the logits", 1, rows * V * (act + 2), 2, "torch"),  # isfinite's bool map, then all()
    ]


def mtp_items(cfg, B: int, R: int, ctx: int, act: int, calls: int, part: str) -> list:
    """The MTP head over R rows per sequence, `part` of it: "forward" (HybridLM.mtp_forward: its input, then its
    one layer), "attention" (mtp_attention, a catch-up: its input and the layer's attention half, which writes the
    K/V rows) or "mlp" (mtp_mlp: the layer's MLP half, its input norm again)."""
    rows, D = B * R, cfg.hidden_size
    attention_half = [Item("mtp embedding, cat", calls, rows * 8 + 6 * rows * D * act, 2, "torch"),
                      Item("mtp rmsnorm", 3 * calls, total(rmsnorm_bytes(rows, D, act, False))),  # enorm, hnorm, input
                      *linear("mtp eh_proj", calls, rows, 2 * D, D, act),
                      *attention(cfg, B, R, ctx, act, calls, "mtp "),
                      Item("mtp rmsnorm+residual", calls, total(rmsnorm_bytes(rows, D, act, True)))]
    mlp_half = [*mlp(cfg, rows, act, calls, "mtp "), Item("mtp h + rm * mlp", calls, 5 * rows * D * act, 2, "torch")]
    if part == "mlp":
        return [Item("mtp post-attention rmsnorm", calls, total(rmsnorm_bytes(rows, D, act, False))), *mlp_half]
    return attention_half + (mlp_half if part == "forward" else [])


def mtp_logits_items(cfg, B: int, act: int, calls: int) -> list:
    """HybridLM.mtp_logits and the greedy pick of a draft: norm, lm_head, scaling, argmax over fp32 logits."""
    D, V = cfg.hidden_size, cfg.vocab_size
    return [Item("mtp norm", calls, total(rmsnorm_bytes(B, D, act, False))),
            *linear("mtp lm_head", calls, B, D, V, act),
            Item("draft logits / scaling, float, argmax", calls, B * V * (3 * act + 8), 3, "torch")]


def step_items(cfg, B: int, gamma: int, ctx: int, act: int = 2) -> dict:
    """The phases of one runner step -> {phase: [Item]}: γ = 0 plain, γ > 0 with the MTP head."""
    K = gamma + 1
    phases = {"verify": verify_items(cfg, B, K, ctx, act)}
    if gamma:
        H, P, N, W = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_d_conv
        phases["propose"] = (mtp_items(cfg, B, 1, ctx, act, 1, "mlp") + mtp_logits_items(cfg, B, act, gamma) +
                             mtp_items(cfg, B, 1, ctx, act, gamma - 1, "forward"))
        phases["commit"] = [Item("commit_state", 1, total(commit_state_bytes(len(cfg.mamba_layers), B, K, H, P, N,
                                                                             cfg.conv_dim, W, act)))]
        phases["catch_up"] = (mtp_items(cfg, B, K, ctx, act, 1, "attention") +
                              [Item("gather_rows", 1, total(gather_rows_bytes(B, cfg.hidden_size, act)))])
    return phases


def us(nbytes: float, tbs: float) -> float:
    return nbytes / (tbs * 1e12) * 1e6


def kernel_table(cfg, ctx: int, tbs: float, act: int = 2) -> list:
    """Rows (kernel, us per call for every (B, K)) of the decode kernels at cfg's shapes."""
    H, P, N, G, W = cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_d_state, cfg.mamba_n_groups, cfg.mamba_d_conv
    Hq, Hkv, Dh, D, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size, cfg.vocab_size
    Lm = len(cfg.mamba_layers)
    cases = [(B, K) for B in BATCHES for K in KS]
    kernels = {
        "mamba_verify": lambda B, K: mamba_verify_bytes(B, K, H, P, N, G, W, act, bias=cfg.mamba_conv_bias),
        f"attention_verify ctx {ctx}": lambda B, K: attention_verify_bytes(B, K, Hq, Hkv, Dh, ctx, act,
                                                                           splits_of(cfg, B, K, ctx)),
        f"commit_state {Lm} layers": lambda B, K: commit_state_bytes(Lm, B, K, H, P, N, cfg.conv_dim, W, act),
        "verdict_greedy": lambda B, K: verdict_greedy_bytes(
            B, K, V, act, split_plan(V, row_stats_meta(V, True)["BLOCK_V"], B * K, N_SM)[1]),
        "verdict_sample": lambda B, K: verdict_sample_bytes(B, K, V, act),
        "gather_rows": lambda B, K: gather_rows_bytes(B, D, act),
        "rmsnorm+residual": lambda B, K: rmsnorm_bytes(B * K, D, act, True),
        "gated_rmsnorm": lambda B, K: gated_rmsnorm_bytes(B * K, cfg.d_inner, act),
    }
    return [(name, [us(total(f(B, K)), tbs) for B, K in cases]) for name, f in kernels.items()]


def summarize(items: list, tbs: float) -> dict:
    by = {kind: sum(i.calls * i.bytes for i in items if i.kind == kind) for kind in ("weights", "kernel", "torch")}
    launches = sum(i.calls * i.launches for i in items)
    return dict(by, bytes=sum(by.values()), us=us(sum(by.values()), tbs), launches=launches)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m nano_spec_kernels.bench --predict",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["350m", "1b"], choices=["shipped", "350m", "1b"])
    ap.add_argument("--tau", type=float, default=TAU, help=f"tokens per γ = 3 step (default {TAU})")
    ap.add_argument("--ctx", type=int, default=CTX, help=f"cache rows each sequence holds (default {CTX})")
    ap.add_argument("--tbs", type=float, default=TBS, help=f"HBM bandwidth in TB/s (default {TBS}, H200)")
    args = ap.parse_args(argv)
    cases = [(B, K) for B in BATCHES for K in KS]
    print(f"roofline: bf16, {args.tbs} TB/s, {args.ctx} cache rows per sequence, tau {args.tau} at γ = 3, "
          f"{N_SM} SMs (split counts)")
    for name, cfg in models(args.model).items():
        weights = summarize(verify_items(cfg, 1, 1, args.ctx), args.tbs)["weights"]
        print(f"\n{name}: D={cfg.hidden_size}, {len(cfg.mamba_layers)} Mamba layers (H={cfg.mamba_n_heads} "
              f"P={cfg.mamba_d_head} N={cfg.mamba_d_state}), {len(cfg.attention_layers)} attention "
              f"(Hq={cfg.num_attention_heads} Hkv={cfg.num_key_value_heads} Dh={cfg.head_dim}), V={cfg.vocab_size}; "
              f"linear and lm_head weights {weights / 1e6:.1f} MB, read in {us(weights, args.tbs):.1f} us")
        head = "".join(f"{f'B={B} K={K}':>12}" for B, K in cases)
        print(f"{'predicted us per call':<28}{head}")
        for kernel, times in kernel_table(cfg, args.ctx, args.tbs):
            print(f"{kernel:<28}" + "".join(f"{t:>12.2f}" for t in times))
        print(f"{'verify step, us':<28}{head}")
        rows = [summarize(verify_items(cfg, B, K, args.ctx), args.tbs) for B, K in cases]
        for label, key in (("  weights (linears, lm_head)", "weights"), ("  kernels", "kernel"),
                           ("  torch ops, activations", "torch")):
            print(f"{label:<28}" + "".join(f"{us(r[key], args.tbs):>12.1f}" for r in rows))
        print(f"{'  total':<28}" + "".join(f"{r['us']:>12.1f}" for r in rows))
        print(f"{'  launches':<28}" + "".join(f"{r['launches']:>12}" for r in rows))
        print(f"{'step':<28}" + "".join(f"{f'B={B}':>12}" for B in BATCHES))
        plain = [summarize(sum(step_items(cfg, B, 0, args.ctx).values(), []), args.tbs) for B in BATCHES]
        spec = [step_items(cfg, B, 3, args.ctx) for B in BATCHES]
        spec_sum = [summarize(sum(p.values(), []), args.tbs) for p in spec]
        print(f"{'plain, us':<28}" + "".join(f"{r['us']:>12.1f}" for r in plain))
        for phase in ("propose", "verify", "commit", "catch_up"):
            print(f"{f'  γ=3 {phase}':<28}" + "".join(f"{summarize(p[phase], args.tbs)['us']:>12.1f}" for p in spec))
        print(f"{'γ=3, us':<28}" + "".join(f"{r['us']:>12.1f}" for r in spec_sum))
        pairs = [f"{a['launches']}/{b['launches']}" for a, b in zip(plain, spec_sum)]
        print(f"{'launches plain / γ=3':<28}" + "".join(f"{x:>12}" for x in pairs))
        print(f"{f'speedup at tau {args.tau}':<28}" + "".join(f"{args.tau * a['us'] / b['us']:>11.2f}x"
                                                             for a, b in zip(plain, spec_sum)))
        print(f"{'tokens/s plain':<28}" + "".join(f"{B / r['us'] * 1e6:>12.0f}" for B, r in zip(BATCHES, plain)))
        print(f"{'tokens/s γ=3':<28}" + "".join(f"{args.tau * B / r['us'] * 1e6:>12.0f}"
                                                for B, r in zip(BATCHES, spec_sum)))


if __name__ == "__main__":
    main()
