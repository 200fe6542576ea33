"""Compile every Triton kernel for a CUDA target without a GPU (python scripts/compile_check.py).

The Triton interpreter, which the CPU tests use, accepts some programs the
compiler rejects. This script runs the real compiler (to PTX and a cubin with the
ptxas that ships in the triton wheel) for sm_90 at realistic shapes, so such
errors show up on a machine with no GPU. It launches nothing. It uses Triton's
ASTSource/GPUTarget entry points, whose form may change between Triton versions.
"""
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels")]  # nano_spec, nano_spec_kernels: runnable without installing

from nano_spec_kernels import (attention_prefill, attention_verify, commit_state, gated_rmsnorm, gather_rows,  # noqa: E402
                     mamba_scan, mamba_verify, rmsnorm, verdict_greedy, verdict_sample)

# pointers default to fp32 and scalars to i32; these are the exceptions
TYPES = {"p_slot": "*i64", "p_na": "*i64", "p_active": "*u8", "p_idx": "*i64", "p_pa": "*i32", "p_drafts": "*i64",
         "p_nd": "*i64", "p_picks": "*i64", "p_tok": "*i64", "p_len": "*i64", "p_mask": "*i32",
         "dt_lo": "fp32", "dt_hi": "fp32", "scale": "fp32", "eps": "fp32", "multiplier": "fp32"}
MAMBA = dict(H=48, P=64, N=128, G=1, W=4, BLOCK_P=16, BLOCK_N=128, BLOCK_W=4)
ATTN = dict(REP=4, K=4, HKV=2, HQ=8, DH=64, DH_PAD=64, BLOCK_M=16, BLOCK_N=64, K_PAD=16, SPLITS=4, SPLITS_PAD=4,
            ROPE=True, DOT_PREC="ieee", BLOCK_T=16)
CASES = [
    (mamba_verify._mamba_verify_kernel, dict(MAMBA, BLOCK_L=8), 4),
    (mamba_verify._conv_window_kernel, dict(Wm1=3, BLOCK_C=256, BLOCK_W=4), 4),
    (commit_state._commit_state_kernel, dict(Wm1=3, BLOCK=1024), 4),
    (mamba_scan._mamba_scan_recurrent_kernel, MAMBA, 4),
    (mamba_scan._mamba_scan_chunked_kernel, dict(MAMBA, Q=mamba_scan.CHUNK), 8),
    (rmsnorm._rmsnorm_kernel, dict(HAS_RES=True, BLOCK_D=2048), 8),
    (gated_rmsnorm._gated_rmsnorm_kernel, dict(BLOCK=4096), 16),
    (attention_prefill._rope_store_kernel, ATTN, 4),
    (attention_prefill._prefill_attention_kernel, dict(ATTN, BLOCK_M=64), 4),
    (attention_verify._verify_attention_kernel, ATTN, 4),
    (attention_verify._combine_kernel, ATTN, 4),
    (gather_rows._gather_rows_kernel, dict(BLOCK_D=256), 4),
    (verdict_greedy._row_stats_kernel, dict(K=4, SPLITS=4, BLOCK_V=1024, HAS_MASK=False), 4),
    (verdict_greedy._row_stats_kernel, dict(K=4, SPLITS=4, BLOCK_V=1024, HAS_MASK=True), 4),
    (verdict_greedy._verdict_kernel, dict(K=4, SPLITS=4, SPLITS_PAD=4), 4),
    (verdict_sample._verdict_sample_kernel, dict(K=1, BLOCK_B=4, BLOCK_V=1024), 4),
    (verdict_sample._verdict_sample_kernel, dict(K=4, BLOCK_B=4, BLOCK_V=1024), 4),
]


def compile_for(kernel, consts: dict, num_warps: int, target: GPUTarget):
    signature, constants = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name], constants[(i,)] = "constexpr", consts[name]
        else:
            signature[name] = TYPES.get(name, "*fp32" if name.startswith("p_") else "i32")
    return triton.compile(ASTSource(kernel, signature, constants), target=target, options={"num_warps": num_warps})


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    done = failed = 0
    for kernel, consts, warps in CASES:
        for has_bias in ([True, False] if "HAS_BIAS" in kernel.arg_names else [None]):
            c = consts if has_bias is None else dict(consts, HAS_BIAS=has_bias)
            label = kernel.fn.__name__ + ("" if has_bias is None else f" HAS_BIAS={has_bias}") + \
                (f" K={c['K']}" if "K" in kernel.arg_names and "K" in c else "") + \
                (f" HAS_MASK={c['HAS_MASK']}" if "HAS_MASK" in c else "")
            try:
                compile_for(kernel, {k: v for k, v in c.items() if k in kernel.arg_names}, warps, target)
                print(f"ok      {label}")
                done += 1
            except Exception as e:  # report every kernel, then fail
                failed += 1
                print(f"FAILED  {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    print(f"{done} kernel variants compiled for sm_90 with triton {triton.__version__}; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
