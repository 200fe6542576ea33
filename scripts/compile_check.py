"""Compile every Triton kernel for sm_90 without a GPU and report what the compiler reports
(python scripts/compile_check.py [--model shipped 350m 1b] [--dtype fp32 bf16]).

The Triton interpreter, which the CPU tests use, accepts some programs the compiler rejects, and says nothing of
how a kernel would run. This script builds the engine's own launches for an H200 (132 SMs) and compiles each with
the real compiler, to PTX and to a cubin with the ptxas that ships in the triton wheel. It launches nothing.

  - The launches: the model (on the meta device, nothing allocated) runs a verify step, a prefill, the verdicts,
    the commit and the MTP seed gather with an Ops whose every op returns its launcher's plan (`<op>_plan`,
    cuda=True) instead of running it. So each kernel is compiled with the constexprs, warps and stages its
    launcher picks for that dtype and shape, and with the arguments the engine passes (views, strides).
  - The variants: fp32 (tests, CPU parity; tl.dot in "ieee") and bf16 (the CUDA default), at the shipped weights'
    shapes and Granite 4.0-H 350m's and 1b's, B in {1, 64}, K in {1, 4} (plain decode and γ = 3), a context of
    1000 rows in a cache of 4096, prompts of 16 tokens (recurrent scan) and 512 (chunked scan). Besides the
    engine's launches, attention_block (the verify kernel non-causal and not writing, for a block drafter) at each
    model's attention heads, a block of DRAFT_BLOCK[model] rows after the same 1000 context rows, B in {1, 64}.
  - The compile: Triton's JIT binder specialises the arguments as a launch would (a pointer or an integer
    divisible by 16 is marked so, an integer equal to 1 becomes a constant); then ASTSource and triton.compile.
    These entry points may change between Triton versions.
  - The report, per compiled variant: registers, stack bytes (spilled registers and local arrays) and static
    shared memory from `cuobjdump --dump-resource-usage` on the cubin; the dynamic shared memory Triton launches
    with (metadata.shared: staged tiles, reduction scratch); and the occupancy those imply on sm_90.

It exits non-zero when a kernel fails to compile or cannot launch (shared memory past 227 KB per block), when a
bf16 variant spills (stack > 0: spills go to local memory and cost the bandwidth a decode kernel exists to save),
or when a bf16 decode-path kernel keeps fewer than MIN_WARPS warps resident per SM (the rule is at MIN_WARPS).
bf16 is what a GPU serves in. fp32 on CUDA is the parity mode: its "ieee" tl.dot runs on the FMA units and at
Dh = 128 cannot hold 16 warps per SM without spilling, so its spills and occupancy are reported, not held to the rule.
"""
import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "kernels"), str(ROOT / "scripts")]  # runnable without installing

from nano_spec.model.cache import HybridCache  # noqa: E402
from nano_spec.model.model import HybridLM  # noqa: E402
from nano_spec.model.ops import MODULE_OF, OP_NAMES  # noqa: E402
from model_shapes import models  # noqa: E402  (scripts/, beside this file)

TARGET = GPUTarget("cuda", 90, 32)
N_SM = 132  # H200 (and H100 SXM): the split counts of attention_verify and verdict_greedy depend on it
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BATCHES, KS = (1, 64), (1, 4)
DRAFT_BLOCK = {"shipped": 8, "350m": 16, "1b": 16}  # attention_block's Kb: the block drafter's block size
CTX, MAX_LEN, PROMPTS = 1000, 4096, (16, 512)
# the ops of a decode step (the block drafter's attention too); prefill-only ops are held to the spill rule alone
DECODE = {"mamba_verify", "attention_verify", "attention_block", "commit_state", "verdict_greedy", "verdict_sample",
          "gather_rows", "rmsnorm", "gated_rmsnorm"}

# ---- sm_90 occupancy ------------------------------------------------------------------------------------------
REGS_PER_SM = 65536
REG_UNIT = 256  # registers are allocated per warp in units of 256 (8 per thread)
THREADS_PER_SM = 2048  # 64 warps
BLOCKS_PER_SM = 32
SMEM_PER_SM = 228 * 1024
SMEM_PER_BLOCK = 227 * 1024  # the most one block may have
# A decode kernel is memory bound: it hides DRAM latency only with enough loads in flight. At 4.8 TB/s over 132
# SMs and ~0.7 us of loaded latency an SM needs ~25 KB in flight (Little's law); 16 warps with a few independent
# 16-byte loads per thread hold that, and 16 warps are 4 per warp scheduler, the least that lets a scheduler
# switch to another warp on every dependent load. Hence at least 16 resident warps per SM (25 % occupancy).
MIN_WARPS = 16


def occupancy(regs: int, smem: int, warps: int) -> tuple[int, str]:
    """(blocks resident per SM, the resource that limits them) for one block of `warps` warps using `regs`
    registers per thread and `smem` bytes of shared memory."""
    regs_per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    limits = {"regs": REGS_PER_SM // regs_per_warp // warps, "threads": THREADS_PER_SM // (32 * warps),
              "blocks": BLOCKS_PER_SM, "smem": SMEM_PER_SM // smem if smem else BLOCKS_PER_SM}
    if smem > SMEM_PER_BLOCK:
        limits["smem"] = 0
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


# ---- the engine's launches -----------------------------------------------------------------------------------
class PlannedOps:
    """The triton backend's ops, each returning its launcher's plan for sm_90 instead of running it:
    the plans collect in `launches` as (op, case, Launch); the outputs are the plan's (meta) tensors."""

    backend = "triton"

    def __init__(self):
        self.launches, self.case = [], ""
        for name in OP_NAMES:
            setattr(self, name, self._planner(name))

    def _planner(self, name):
        module = importlib.import_module(f"nano_spec_kernels.{MODULE_OF.get(name, name)}")  # as Ops binds them
        plan = getattr(module, f"{name}_plan")

        def call(*args, **kwargs):
            launches, out = plan(*args, cuda=True, n_sm=N_SM, **kwargs)
            self.launches += [(name, self.case, launch) for launch in launches]
            return out

        return call


def engine_launches(cfg, dtype: torch.dtype) -> list:
    """Every launch of the verify steps (B in BATCHES, K in KS) and prefills (PROMPTS) of model cfg in dtype."""
    ops = PlannedOps()
    with torch.device("meta"):
        model = HybridLM(cfg, ops).to(dtype).for_inference()
    meta = dict(device="meta")
    for B in BATCHES:
        for K in KS:
            ops.case = f"B={B} K={K}"
            cache = HybridCache(cfg, B, MAX_LEN, K, "meta", dtype)  # B slots, one row each
            slots, lens = torch.arange(B, **meta), torch.full((B,), CTX, **meta)
            logits = model.verify(torch.zeros(B, K, dtype=torch.long, **meta), slots, lens, cache, CTX + K)
            drafts, nd = torch.zeros(B, K - 1, dtype=torch.long, **meta), torch.full((B,), K - 1, **meta)
            ops.verdict_greedy(logits, drafts, nd)
            words = torch.zeros(B, K, -(-cfg.vocab_size // 32), dtype=torch.int32, **meta)
            ops.verdict_greedy(logits, drafts, nd, words)  # under a grammar's bitmask
            q = torch.zeros(B, K - 1, cfg.vocab_size, **meta)  # draft probabilities, fp32 as sampling makes them
            ops.verdict_sample(logits, q, drafts, nd, torch.zeros(B, K, **meta), torch.ones(B, **meta),
                               torch.zeros(B, dtype=torch.long, **meta), torch.ones(B, **meta))
            na = torch.zeros(B, dtype=torch.long, **meta)
            ops.commit_state(cache.ssm_state, cache.conv_state, cache.ssm_stash(B, K), cache.conv_stash(B, K),
                             slots, na, na < K - 1)
            ops.gather_rows(cache.hidden_stash(B, K), na)  # the MTP seed
    for T in PROMPTS:
        ops.case = f"T={T}"
        model.prefill(torch.zeros(T, dtype=torch.long, **meta), 0, HybridCache(cfg, 1, MAX_LEN, 1, "meta", dtype))
    return ops.launches


def block_launches(cfg, dtype: torch.dtype, Kb: int) -> list:
    """attention_block's launches for a drafter with cfg's attention heads: a block of Kb rows (views of one fused
    qkv projection, as the model's) after CTX context rows of a MAX_LEN-row cache, B in BATCHES."""
    ops = PlannedOps()
    Hq, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    meta = dict(device="meta")
    for B in BATCHES:
        ops.case = f"B={B} Kb={Kb}"
        qkv = torch.zeros(B, Kb, (Hq + 2 * Hkv) * Dh, dtype=dtype, **meta)
        q, k, v = qkv.split([Hq * Dh, Hkv * Dh, Hkv * Dh], -1)
        kc, vc = (torch.zeros(B, MAX_LEN, Hkv, Dh, dtype=dtype, **meta) for _ in range(2))
        slots, lens = torch.arange(B, **meta), torch.full((B,), CTX, **meta)
        ops.attention_block(q.unflatten(-1, (Hq, Dh)), k.unflatten(-1, (Hkv, Dh)), v.unflatten(-1, (Hkv, Dh)),
                            kc[:, :CTX], vc[:, :CTX], slots, lens, cfg.attention_multiplier, cfg.rope)
    return ops.launches


# ---- compiling and reading the cubin ---------------------------------------------------------------------------
def cuobjdump() -> str:
    here = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    found = str(here) if here.exists() else shutil.which("cuobjdump")
    if not found:
        raise SystemExit("compile_check: no cuobjdump (neither in the triton wheel nor on PATH)")
    return found


BACKEND = make_backend(TARGET)
_BINDERS = {}


def specialise(launch) -> tuple:
    """(signature, constexprs, attrs, options) of a launch, bound the way Triton's JIT binds one."""
    fn, kwargs = launch.kernel, dict(launch.meta)
    if fn not in _BINDERS:
        _BINDERS[fn] = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound, spec, options = _BINDERS[fn](*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(BACKEND, kwargs, bound, spec, options)
    return signature, constexprs, attrs, options


def resources(launch, tool: str) -> dict:
    """Compile one launch for sm_90; registers, stack, shared memory, warps, stages."""
    signature, constexprs, attrs, options = specialise(launch)
    kernel = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=TARGET,
                            options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        dump = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", dump)
    if not m:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {dump!r}")
    regs, stack, static = map(int, m.groups())
    warps, smem = kernel.metadata.num_warps, static + kernel.metadata.shared
    blocks, limiter = occupancy(regs, smem, warps)
    return dict(regs=regs, stack=stack, smem=smem, warps=warps, stages=kernel.metadata.num_stages, blocks=blocks,
                resident=blocks * warps, limiter=limiter)


def problems(op: str, dtype: str, r: dict) -> list:
    """What breaks the rule of the module docstring."""
    bad = []
    if r["blocks"] == 0:
        bad.append("cannot launch")
    if dtype == "bf16" and r["stack"] > 0:
        bad.append("spills")
    if dtype == "bf16" and op in DECODE and r["resident"] < MIN_WARPS:
        bad.append(f"< {MIN_WARPS} warps/SM")
    return bad


def key_of(launch) -> str:
    signature, constexprs, attrs, options = specialise(launch)
    return repr((launch.kernel.fn.__qualname__, sorted(signature.items()), sorted(constexprs.items()),
                 sorted(attrs.items()), options.num_warps, options.num_stages))


def label(launch) -> str:
    """The kernel and the meta-parameters that tell its variants apart."""
    keep = ("K", "BLOCK_M", "BLOCK_N", "BLOCK_P", "BLOCK_L", "BLOCK_V", "BLOCK_D", "BLOCK", "SPLITS", "HAS_MASK",
            "HAS_RES", "Q", "CAUSAL")
    meta = " ".join(f"{k}={v}" for k, v in launch.meta.items() if k in keep)
    return f"{launch.kernel.fn.__name__} {meta}".strip()


def cases_text(cases: list) -> str:
    """["B=1 K=1", "B=64 K=1"] -> "B=1,64 K=1": the values each size takes."""
    values = {}
    for case in cases:
        for item in case.split():
            k, v = item.split("=")
            values.setdefault(k, [])
            if v not in values[k]:
                values[k].append(v)
    return " ".join(f"{k}={','.join(v)}" for k, v in values.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["shipped", "350m", "1b"], choices=["shipped", "350m", "1b"])
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = ap.parse_args(argv)
    tool, done, failed, broken = cuobjdump(), {}, 0, []
    print(f"triton {triton.__version__}, sm_90, {N_SM} SMs; occupancy: {REGS_PER_SM} regs/SM in units of "
          f"{REG_UNIT} per warp, {THREADS_PER_SM} threads, {BLOCKS_PER_SM} blocks, {SMEM_PER_SM // 1024} KB smem; "
          f"rule: bf16 stack = 0, bf16 decode kernels >= {MIN_WARPS} warps/SM")
    for name, cfg in models(args.model).items():
        for dname in args.dtype:
            rows = {}  # (op, label, what the compiler reports) -> [op, label, cases, resources or error]
            launches = engine_launches(cfg, DTYPES[dname]) + block_launches(cfg, DTYPES[dname], DRAFT_BLOCK[name])
            for op, case, launch in launches:
                key = key_of(launch)
                try:
                    if key not in done:
                        done[key] = resources(launch, tool)
                    r = done[key]
                except Exception as e:  # report every kernel, then fail
                    r = done[key] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                row = rows.setdefault(repr((op, label(launch), r)), [op, label(launch), [], r])
                row[2] += [] if case in row[2] else [case]
            print(f"\n{name} {dname}: D={cfg.hidden_size} H={cfg.mamba_n_heads} P={cfg.mamba_d_head} "
                  f"N={cfg.mamba_d_state} Hq={cfg.num_attention_heads} Hkv={cfg.num_key_value_heads} "
                  f"Dh={cfg.head_dim} V={cfg.vocab_size}")
            print(f"{'kernel':<74} {'cases':<22} {'warps':>5} {'stages':>6} {'regs':>4} {'stack':>5} {'smem B':>7} "
                  f"{'blocks':>6} {'warps/SM':>8} {'limit':>7}  check")
            for op, lab, cases, r in sorted(rows.values(), key=lambda row: (row[0] not in DECODE, row[1])):
                shown = cases_text(cases)
                if isinstance(r, str):
                    failed += 1
                    print(f"{lab:<74} {shown:<22} FAILED {r}")
                    continue
                bad = problems(op, dname, r)
                broken += [f"{name} {dname} {lab}: {', '.join(bad)}"] if bad else []
                print(f"{lab:<74} {shown:<22} {r['warps']:>5} {r['stages']:>6} {r['regs']:>4} {r['stack']:>5} "
                      f"{r['smem']:>7} {r['blocks']:>6} {r['resident']:>8} {r['limiter']:>7}  "
                      f"{'; '.join(bad) if bad else 'ok'}")
    print(f"\n{len(done)} kernel variants compiled for sm_90 with triton {triton.__version__}; {failed} failed; "
          f"{len(broken)} break the rule")
    for line in broken:
        print(f"  {line}")
    return 1 if failed or broken else 0


if __name__ == "__main__":
    sys.exit(main())
