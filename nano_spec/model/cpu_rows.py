"""The operators a compiled CPU step calls, with their kernels in C++ (cpu_rows.cpp; docs/DESIGN.md §12): the
Mamba recurrence of a verify, the cache writes, the attention over a slot's cache, the commit, and the products of
a few rows by a weight. A kernel
registered from C++ costs ~1.6 us of dispatch a call from a graph; a Python kernel, ~10 (measured).

1. The recurrence (mamba_write, "The K-row recurrence").

For each sequence b and head h of group g = h // (H/G), over the rows k = 1..K of the step:

    S_k = a_k S_{k-1} + u_k ⊗ B_k          S (P, N) fp32, a_k = exp(dt_k A), u_k = dt_k x_k (P,)
    stash[b, k-1] = S_k;  y_k = S_k C_k    (P,);  the slot's state becomes S_K

Written as torch ops in a compiled graph, each row's state went to a buffer, was read back for y, and copied
again into the stash: about 4x the bytes of the state per row. Here one head's state (16 KB at the 350m shape)
stays in L1 across the K rows and each row's state is written once: into the stash, the last row's into the live
state (a commit rewinds to a row before the last, so the stash's last row is never read). A call's stash rows of
2 MB or more go past the caches (non-temporal stores): through them, they would push the next step's weights out.
The state's arithmetic is the torch reference's (a*S rounded, u*B rounded, then the sum: no fused multiply-add), so
the stash and the state equal mamba_verify_ref's bit for bit; y sums over N in a fixed order of its own, the same
at any K. A compiled engine's prompts run the same loop over their T rows (mamba_scan_rows), the state overwritten
in place: no stash; their conv too (conv_rows).

2. The writes (mamba_write's conv, kv_write, commit_state): row copies (memcpy) into the slots, of any dtype.
The attention (attend, "Attention over the rows a query sees"): query row (b, j) over its slot's cache rows
0..pos[b, j], the count read inside the op, so a graph's static KV length costs nothing; the rows that share a KV
head read each block of the cache once, each row's sums in one order of its own, the same bit for bit in any call.

3. The products (rows_linear, "K rows by a packed weight"): y (M, N) = x (M, K) W^T for M <= ROWS_MAX rows. ATen's
GEMM copies the weight blocks it reads on every call and runs 4 rows at ~3x the time of one; here the weight is
packed once (pack_rows: blocks of NB output columns, each contiguous) and each block's MB-row sums stay in vector
registers, so one pass over the weight serves MB rows (8 with AVX-512: a verify's K rows in one pass; up to 6 go
over two blocks at once). Row m's sums run over K in one order whatever M, each term fused into its sum, so a row
comes out the same, bit for bit, in a 1-row and in a K-row call. A drafter's weights are packed in int8, a scale per
output column (its products read a quarter of the bytes; the sums stay fp32): a draft only proposes, the target's
fp32 verify decides.

A step of one row reads every weight once and does little else with it, so its products run at the speed memory
delivers the weights. A network's packed copies lie in one block of memory on 2 MB pages where the OS grants them
(on_huge_pages): with 4 KB pages the ~27 MB of the shipped weights span ~6,600 pages, more than the TLB holds, and
each step walks the page tables again (DESIGN §12 has the measurements).

The library is built once per machine and torch with the C++ compiler inductor also needs (c++, or $CXX), and
cached.
"""
import functools
import hashlib
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_rows.cpp")  # the kernels of the ops below, and rows_mm
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most arm64 kernels
ROWS_MAX = 16  # rows up to which rows_mm beats ATen's GEMM on one thread (docs/BENCHMARKS.md, "K rows")
DRAFT_ROWS_MAX = 64  # a drafter's int8 copy: a step's rows (batch x block) stay in rows_mm, a prompt's go to ATen
DRAFT_DTYPE = torch.int8  # a drafter's packed copies (pack_rows): the target's are fp32
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c++20", f"-DROWS_MAX={ROWS_MAX}",
         f"-DDRAFT_ROWS_MAX={DRAFT_ROWS_MAX}")
OPENMP = "-fopenmp"  # rows_mm's threads (at::parallel_for); a compiler without OpenMP builds it serial


def build() -> Path:
    """SOURCE built for this machine and this torch (-march=native: the cache key names the CPU) into the cache
    directory, unless it is there: the library's path."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("compile: the CPU step graph needs a C++ compiler (c++, g++ or clang++, or $CXX), as "
                           "torch.compile's inductor does")
    cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "") \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    key = hashlib.sha256("\n".join([SOURCE.read_text(), cxx, *FLAGS, OPENMP, platform.machine(), cpu,
                                    torch.__version__, torch.__file__]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nano_spec"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: the temporary directory, built again after a reboot
        cache = Path(tempfile.gettempdir()) / f"nano_spec-{os.getuid() if hasattr(os, 'getuid') else 0}"
        cache.mkdir(exist_ok=True)
    path = cache / f"cpu_rows_{key}.so"
    if not path.exists():
        from torch.utils.cpp_extension import include_paths, library_paths
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then moved in whole
            out = Path(tmp) / "cpu_rows.so"
            abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
            for openmp in ([OPENMP], []):
                done = subprocess.run([cxx, *FLAGS, *openmp, abi, *(f"-I{p}" for p in include_paths()), str(SOURCE),
                                       "-o", str(out), *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu"],
                                      capture_output=True, text=True)
                if done.returncode == 0:
                    break
            if done.returncode != 0:
                raise RuntimeError(f"compile: {cxx} could not build the CPU step's kernels:\n{done.stderr[-2000:]}")
            os.replace(out, path)
    return path


@functools.cache
def library():
    """The library built (build) and loaded, once per process: its kernels serve the nano_spec:: ops on CPU
    tensors from then on. Returns torch.ops.nano_spec."""
    torch.ops.load_library(str(build()))
    return torch.ops.nano_spec


LIB = torch.library.Library("nano_spec", "FRAGMENT")  # holds the ops below: dropped, it would unregister them


def cpu_op(schema: str, meta=lambda *args: None):
    """The operator nano_spec::<schema>, its CPU kernel in SOURCE. A write op's writes are in its schema, so a graph
    hands it the cache views and it writes in place; traced, an op runs nothing and returns meta(*args), its new
    outputs (None for a write op). Its Python kernel runs once, on the first call: it loads the library, whose
    kernel serves that call and every later one."""
    name = schema.split("(")[0]

    def first_call(*args):
        if any(isinstance(a, Tensor) and a.device.type != "cpu" for a in args):
            raise ValueError(f"nano_spec::{name} has a CPU kernel only")
        ops = library()
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"nano_spec::{name}", "CPU"):  # else: this again
            raise RuntimeError(f"nano_spec::{name}: {SOURCE.name} registers no CPU kernel for it")
        return getattr(ops, name).default(*args)
    LIB.define(schema)
    LIB.impl(name, first_call, "CompositeExplicitAutograd")
    LIB.impl(name, meta, "Meta")
    return getattr(torch.ops.nano_spec, name).default


# ---- 1. the K-row recurrence -----------------------------------------------------------------------------------
# The K rows' recurrence and conv writes of a Mamba verify, in place: conv_state (S, C, W-1) and ssm_state
# (S, H, P, N) fp32, slots contiguous, advanced at slot_ids (B,); conv_stash (B, C, W-1+K) and ssm_stash
# (B, K, H, P, N) fp32, contiguous, written: the stash's rows 0..K-2 only where the slots differ (the last row's
# state, which no commit reads, goes straight to the live state), all K where a padded batch repeats a slot; window
# (B, C, W-1+K) the conv's inputs (the slot's last W-1 and the K new); decay (B, K, H), u (B, K, H, P), B and C
# (B, K, G, N), read where they lie when each row's G N values are together and the rows one stride apart (views
# of the step's xBC rows), else copied. Returns y (B, K, H, P) fp32, without the D x skip.
mamba_write = cpu_op(
    "mamba_write(Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor(c!) conv_stash, Tensor(d!) ssm_stash, "
    "Tensor slot_ids, Tensor window, Tensor decay, Tensor u, Tensor B, Tensor C) -> Tensor",
    meta=lambda *args: torch.empty_like(args[7], dtype=torch.float32))  # y (B, K, H, P), the shape of u = args[7]

# A prompt's T rows from the state given (zeros for a new prompt), in place: state (H, P, N) fp32 contiguous, decay
# (T, H), u (T, H, P), B and C (T, G, N). Returns y (T, H, P) fp32, without the D x skip. Heads share the threads.
mamba_scan_rows = cpu_op("mamba_scan_rows(Tensor(a!) state, Tensor decay, Tensor u, Tensor B, Tensor C) -> Tensor",
                         meta=lambda state, decay, u, B, C: torch.empty_like(u, dtype=torch.float32))

# A prompt's causal depthwise conv from a zero window: x (T, C), weight (C, W), bias (C,) or None -> (T, C) fp32, each
# row's taps added in order, then the bias (ssd.conv_silu_tokens' sums before its SiLU, bit for bit), rows over the
# threads
conv_rows = cpu_op("conv_rows(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                   meta=lambda x, weight, bias: x.new_empty(x.shape, dtype=torch.float32))

# ---- 2. the attention rows and the commit ------------------------------------------------------------------------
# rows k, v (B, K, Hkv, Dh) into the caches (S, L, Hkv, Dh) at slots slot_ids (B,), positions pos (B, K)
kv_write = cpu_op("kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_ids, Tensor pos, Tensor k, "
                  "Tensor v) -> ()")
# attention of query rows q (B, K, Hq, Dh) fp32, already rotated, over the caches (S, L, Hkv, Dh) of slots slot_ids
# (B,): row (b, j) sees cache rows 0 .. pos[b, j] and no others, however long the cache -> o (B, K, Hq, Dh) fp32;
# attend_block: then its sequence's own rows k_own, v_own (B, E, Hkv, Dh) too (a block's, not in the cache)
attend = cpu_op("attend(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot_ids, Tensor pos, float scale) -> Tensor",
                meta=lambda q, *args: torch.empty_like(q, dtype=torch.float32))
attend_block = cpu_op("attend_block(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot_ids, Tensor pos, "
                      "float scale, Tensor k_own, Tensor v_own) -> Tensor",
                      meta=lambda q, *args: torch.empty_like(q, dtype=torch.float32))
# commit_state_ref's contract (nano_spec_kernels/commit_state.py) in place, the rows that move found in C++
commit_state = cpu_op("commit_state(Tensor(a!) ssm_state, Tensor(b!) conv_state, Tensor ssm_stash, "
                      "Tensor conv_stash, Tensor slot_ids, Tensor na, Tensor active) -> ()")


# ---- 3. few rows by a packed weight ------------------------------------------------------------------------------
def int8_rows(weight: Tensor) -> tuple:
    """weight (N, K) -> (q (N, K) int8, scale (N,) fp32), weight ~ q * scale[:, None]: each row (an output column of
    the product) over its own symmetric range, max |w| at 127, rounded to nearest (a zero row: zeros, scale 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0.0)
    return q.round().clamp(-127, 127).to(torch.int8), scale


def pack_rows(weight: Tensor, dtype=torch.float32) -> Tensor:
    """weight (N, K), any layout -> its packed copy (ceil(N / NB), K, NB) for rows_mm: block j holds output columns
    j NB .. j NB + NB - 1 in order, zeros past N. An int8 copy (a drafter's, DRAFT_DTYPE: a quarter of the bytes;
    int8_rows) ends each block with its columns' NB fp32 scales, as 4 more rows of bytes: (ceil(N / NB), K + 4, NB)."""
    if dtype not in (torch.float32, torch.int8):
        raise ValueError(f"pack_rows: dtype {dtype} is not float32 or int8")
    NB, (N, K) = library().rows_block(), weight.shape
    values, scale = int8_rows(weight) if dtype == torch.int8 else (weight.detach(), None)
    packed = torch.zeros(-(-N // NB) * NB, K, dtype=dtype, device=weight.device)
    packed[:N] = values
    packed = packed.view(-1, NB, K).transpose(1, 2)  # (N / NB, K, NB)
    if scale is not None:
        tail = torch.zeros(packed.shape[0] * NB, dtype=torch.float32, device=weight.device)
        tail[:N] = scale
        packed = torch.cat([packed, tail.view(torch.int8).view(-1, 4, NB)], dim=1)  # (N / NB, K + 4, NB)
    return packed.contiguous()


def on_huge_pages(tensors: list):
    """Copies of CPU tensors, yielded in order, in one private anonymous mapping advised for transparent huge pages,
    each its own storage at a multiple of 64 bytes from a 2 MB boundary (a graph that freezes weights as constants
    wants no views into a shared storage), with the strides of a dense tensor kept (an input-major weight stays so);
    each copy keeps the mapping alive. The mapping's pages are made as the copies are written, so a caller that
    drops each original as its copy comes holds at most one tensor twice. Where the OS has no such advice (not
    Linux) the tensors come back as they are. The kernel grants 2 MB pages if it can: with THP set to `never`, or
    none free, the copies still work, on small pages."""
    if not tensors or not hasattr(mmap, "MADV_HUGEPAGE"):
        yield from tensors
        return
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // 64) * 64
    block = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    block.madvise(mmap.MADV_HUGEPAGE)
    start = -torch.frombuffer(block, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    for i, o in enumerate(offsets):
        t = tensors[i]  # read now: the caller may have replaced the ones before
        if t.numel() == 0:
            yield torch.empty_like(t)
            continue
        flat = torch.frombuffer(block, dtype=t.dtype, count=t.numel(), offset=start + o)  # holds a reference to block
        yield dense_like(flat, t).copy_(t)


def dense_like(flat: Tensor, t: Tensor) -> Tensor:
    """flat (t.numel(),) with t's shape, and t's strides where t is dense (empty_like's rule, asked on meta)."""
    return flat.as_strided(t.shape, torch.empty_like(t, device="meta").stride())


def rows_mm(x: Tensor, packed: Tensor, n: int) -> Tensor:
    """x (M, K) fp32 times the weight (n, K) that pack_rows packed -> y = x W^T (M, n) fp32, its column blocks
    shared out over torch's threads (the same sums whatever their count)."""
    return library().rows_mm(x, packed, n)


def rows_weight(packed: Tensor, n: int) -> Tensor:
    """The weight (n, K) fp32 that an int8 copy (pack_rows) holds: q * scale, what its products multiply by."""
    return library().rows_weight(packed, n)


def rows_max(dtype) -> int:
    """The most rows a product by a weight packed in dtype hands to rows_mm: a drafter's int8 copy, which ATen can
    only read through a weight made from it per call, serves a whole step's rows."""
    return DRAFT_ROWS_MAX if dtype == torch.int8 else ROWS_MAX


def runs_in_c(rows: int, dtype=torch.float32) -> bool:
    """Whether a product of this many rows by a weight packed in dtype runs in rows_mm: at most rows_max(dtype),
    on one thread unless the copy is a drafter's int8 one (rows_linear's kernel asks the same)."""
    return rows <= rows_max(dtype) and (dtype == torch.int8 or torch.get_num_threads() == 1)


# x (M, K) W^T -> (M, N) for the weight (N, K) and its packed copy: rows_mm where runs_in_c, else ATen's GEMM over
# the weight (the one an int8 copy holds, rows_weight), which uses the threads (their count may change between calls)
rows_linear = cpu_op("rows_linear(Tensor x, Tensor packed, Tensor weight) -> Tensor",
                     meta=lambda x, packed, weight: x.new_empty(x.shape[0], weight.shape[0]))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), over the packed copy of the weight where there is one and x has at most ROWS_MAX
    rows, DRAFT_ROWS_MAX for an int8 copy (a compiled CPU step's; a prompt's rows go to ATen's GEMM). An int8 copy
    is a drafter's: its weight is read at int8 precision in every call."""
    rows = x.numel() // x.shape[-1]
    if packed is not None and (packed.dtype == DRAFT_DTYPE or rows <= ROWS_MAX):
        # an int8 copy's products all go to its op, which hands many rows to ATen over the weight it holds
        y = rows_linear(x.reshape(rows, x.shape[-1]), packed, weight).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class RowsLinear(nn.Module):
    """An nn.Linear's weight and bias (the same tensors under the same names) with a packed copy of the weight."""

    def __init__(self, lin: nn.Linear, packed: Tensor | None = None):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self.register_buffer("packed", pack_rows(lin.weight) if packed is None else packed, persistent=False)

    def forward(self, x):
        return linear(x, self.weight, self.bias, self.packed)


def pack_linears(net: nn.Module, dtype=torch.float32, skip=()):
    """Every fp32 weight of net that a step multiplies gets its packed copy in dtype (pack_rows): its nn.Linear
    layers become RowsLinear, and a module that multiplies a weight itself names it in `packs`, (weight attribute,
    its packed buffer) pairs (layers.Attention's fused q/k/v, the output layer). The modules under `skip` (a
    drafter's, inside the target) are left to their own call. The copies lie together on huge pages
    (on_huge_pages). Other dtypes keep ATen's GEMM. An embedding table is laid out row by row again (the same
    Parameter and values, on huge pages): model.for_inference stores it input-major for ATen's products by the tied
    head, which a step now runs over the packed copy, while each lookup of a token gathers a whole row."""
    skipped = {id(m) for s in skip for m in s.modules()}
    modules = [m for m in net.modules() if id(m) not in skipped]
    linears, owners = [], []  # (module, child name, nn.Linear); (module, packed attribute, weight)
    for module in modules:
        linears += [(module, name, child) for name, child in module.named_children()
                    if isinstance(child, nn.Linear) and id(child) not in skipped]
        owners += [(module, packed, getattr(module, weight)) for weight, packed in getattr(module, "packs", ())
                   if getattr(module, weight) is not None]
    weights = [lin.weight for *_, lin in linears] + [w for *_, w in owners]
    if not weights or any(w.dtype != torch.float32 for w in weights):
        return
    packed = on_huge_pages([pack_rows(w, dtype) for w in weights])
    for module, name, lin in linears:
        setattr(module, name, RowsLinear(lin, next(packed)))
    for module, attr, _ in owners:
        setattr(module, attr, next(packed))
    tables = [m.weight for m in modules if isinstance(m, nn.Embedding) and not m.weight.is_contiguous()]
    for table, rows in zip(tables, on_huge_pages([t.data.contiguous() for t in tables])):
        table.data = rows
