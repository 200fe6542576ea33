"""The compiled CPU step's K-row work in C (docs/DESIGN.md §12): the Mamba recurrence of a verify, and the products
of a few rows by a weight.

1. The recurrence ("The K-row recurrence").

For each sequence b and head h of group g = h // (H/G), over the rows k = 1..K of the step:

    S_k = a_k S_{k-1} + u_k ⊗ B_k          S (P, N) fp32, a_k = exp(dt_k A), u_k = dt_k x_k (P,)
    stash[b, k-1] = S_k;  y_k = S_k C_k    (P,);  the slot's state becomes S_K

Written as torch ops in a compiled graph, each row's state went to a buffer, was read back for y, and copied
again into the stash: about 4x the bytes of the state per row. Here one head's state (16 KB at the 350m shape)
stays in L1 across the K rows and each row's state is written once, into the stash. The state's arithmetic is
the torch reference's (a*S rounded, u*B rounded, then the sum: no fused multiply-add), so the stash and the
state equal mamba_verify_ref's bit for bit; y sums over N in a fixed order of its own, the same at any K.

2. The products ("K rows by a packed weight"): y (M, N) = x (M, K) W^T for M <= ROWS_MAX rows. ATen's GEMM
copies the weight blocks it reads on every call and runs 4 rows at ~3x the time of one; here the weight is packed
once (pack_rows: blocks of NB output columns, each contiguous) and each block's MB-row sums stay in vector
registers, so one pass over the weight serves MB rows. Row m's sums run over K in one order whatever M, so a row
comes out the same, bit for bit, in a 1-row and in a K-row call.

The library is built once per machine with the C compiler inductor also needs (cc, or $CC), and cached.
"""
import ctypes
import functools
import hashlib
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

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#define LANES 16  /* y's partial sums, one per SIMD lane: a fixed order the compiler can vectorize */

int mamba_rows(const float *decay, const float *u, const float *Bm, const float *Cm, float *state,
               int64_t num_slots, int64_t slot_stride, const int64_t *slots, float *stash, float *y,
               int64_t nb, int64_t K, int64_t H, int64_t G, int64_t P, int64_t N) {
  for (int64_t b = 0; b < nb; b++)
    if (slots[b] < 0 || slots[b] >= num_slots) return 1;  /* before anything is written */
  for (int64_t b = 0; b < nb; b++)
    for (int64_t h = 0; h < H; h++) {
      const float *prev = state + slots[b] * slot_stride + h * P * N;
      int64_t g = h / (H / G);
      for (int64_t k = 0; k < K; k++) {  /* row k reads row k-1's state from the stash, still in L1 */
        int64_t bk = b * K + k;
        float a = decay[bk * H + h], *out = stash + (bk * H + h) * P * N;
        const float *Bn = Bm + (bk * G + g) * N, *Cn = Cm + (bk * G + g) * N;
        for (int64_t p = 0; p < P; p++) {
          float up = u[(bk * H + h) * P + p], acc[LANES] = {0}, sum = 0;
          const float *s = prev + p * N;
          float *o = out + p * N;
          int64_t n = 0;
          for (; n + LANES <= N; n += LANES)
            for (int l = 0; l < LANES; l++) {
              float v = a * s[n + l] + up * Bn[n + l];
              o[n + l] = v;
              acc[l] += v * Cn[n + l];
            }
          for (int l = 0; l < LANES; l++) sum += acc[l];
          for (; n < N; n++) {
            float v = a * s[n] + up * Bn[n];
            o[n] = v;
            sum += v * Cn[n];
          }
          y[(bk * H + h) * P + p] = sum;
        }
        prev = out;
      }
    }
  /* the live states last: a padded batch repeats a slot, and every row must read the state before the step */
  for (int64_t b = 0; b < nb; b++)
    memcpy(state + slots[b] * slot_stride, stash + ((b * K + K - 1) * H) * P * N, H * P * N * sizeof(float));
  return 0;
}

#ifdef __AVX512F__
#define NB 32  /* a block's output columns: two vectors of 16 lanes */
#else
#define NB 16  /* 16 vector registers (AVX2, NEON): MB rows' sums must still fit in them */
#endif
#define MB 4   /* rows per pass over a block */
typedef float half __attribute__((vector_size(NB * 2), aligned(4)));  /* NB / 2 lanes, loaded unaligned */

int rows_block(void) { return NB; }

/* mb rows of x (mb, Kd) times one packed block w (Kd, NB) -> y (mb, n), n <= NB: each row's sums over k in order */
static inline __attribute__((always_inline))
void rows_pass(const float *x, const float *w, float *y, int mb, int64_t Kd, int64_t N, int64_t n) {
  half acc[MB][2] = {{{0}}};
  for (int64_t k = 0; k < Kd; k++) {
    half w0 = *(const half *)(w + k * NB), w1 = *(const half *)(w + k * NB + NB / 2);
    for (int m = 0; m < mb; m++) {
      float xm = x[m * Kd + k];
      acc[m][0] += xm * w0;
      acc[m][1] += xm * w1;
    }
  }
  for (int m = 0; m < mb; m++) memcpy(y + m * N, acc[m], n * sizeof(float));  /* the row's NB sums, cut to n */
}

/* y (M, N) = x (M, Kd) @ the packed weight (ceil(N / NB), Kd, NB); a block stays in cache across the row passes */
void rows_mm(const float *x, const float *w, float *y, int64_t M, int64_t Kd, int64_t N) {
  for (int64_t n0 = 0; n0 < N; n0 += NB) {
    const float *block = w + n0 * Kd;
    int64_t n = N - n0 < NB ? N - n0 : NB;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const float *xm = x + m0 * Kd;
      float *ym = y + m0 * N + n0;
      switch (M - m0 < MB ? M - m0 : MB) {  /* constant row counts: the sums unrolled into registers */
        case 1: rows_pass(xm, block, ym, 1, Kd, N, n); break;
        case 2: rows_pass(xm, block, ym, 2, Kd, N, n); break;
        case 3: rows_pass(xm, block, ym, 3, Kd, N, n); break;
        default: rows_pass(xm, block, ym, MB, Kd, N, n);
      }
    }
  }
}
"""
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")


@functools.cache
def library() -> ctypes.CDLL:
    """SOURCE built for this machine (-march=native: the cache key names the CPU), once per process."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("compile: the CPU step graph needs a C compiler (cc, gcc or clang, or $CC), as "
                           "torch.compile's inductor does")
    cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "") \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    key = hashlib.sha256("\n".join([SOURCE, cc, *FLAGS, platform.machine(), cpu]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "nano_spec"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: the temporary directory, built again after a reboot
        cache = Path(tempfile.gettempdir()) / f"nano_spec-{os.getuid() if hasattr(os, 'getuid') else 0}"
        cache.mkdir(exist_ok=True)
    path = cache / f"cpu_rows_{key}.so"
    if not path.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then moved in whole
            src, out = Path(tmp) / "cpu_rows.c", Path(tmp) / "cpu_rows.so"
            src.write_text(SOURCE)
            done = subprocess.run([cc, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"compile: {cc} could not build the CPU step's C kernels:\n{done.stderr[-2000:]}")
            os.replace(out, path)
    lib = ctypes.CDLL(str(path))
    pointers, sizes = ctypes.c_void_p, ctypes.c_int64  # the return type is ctypes' default, a C int
    lib.mamba_rows.argtypes = [pointers] * 5 + [sizes] * 2 + [pointers] * 3 + [sizes] * 6
    lib.rows_mm.argtypes = [pointers] * 3 + [sizes] * 3
    lib.block = lib.rows_block()  # NB, read once: rows_mm checks it on every call
    return lib


def mamba_rows(ssm_state: Tensor, ssm_stash: Tensor, slot_ids: Tensor, decay: Tensor, u: Tensor, Bm: Tensor,
               Cm: Tensor) -> Tensor:
    """decay (B, K, H), u (B, K, H, P), Bm and Cm (B, K, G, N), all fp32; ssm_state (S, H, P, N) fp32 with
    contiguous slots, advanced in place at slot_ids (B,); ssm_stash (B, K, H, P, N) fp32 contiguous, written.
    Returns y (B, K, H, P) fp32, without the D x skip."""
    # checked by hand, not with the launchers' Checker.args: this runs per Mamba layer on every compiled step, and
    # the table walk costs 17 us a call against 1.5 (measured, the 350m shape)
    Bsz, K, H, P = u.shape
    G, N = Bm.shape[2], Bm.shape[3]
    state_ok = ssm_state.shape[1:] == (H, P, N) and ssm_state.stride()[1:] == (P * N, N, 1)
    if ssm_state.dtype != torch.float32 or ssm_stash.dtype != torch.float32 or not state_ok \
            or ssm_stash.shape != (Bsz, K, H, P, N) or not ssm_stash.is_contiguous():
        raise ValueError("mamba_rows: ssm_state must be fp32 (S, H, P, N) with contiguous slots, and ssm_stash a "
                         "contiguous fp32 (B, K, H, P, N)")
    decay, u, Bm, Cm = (t.float().contiguous() for t in (decay, u, Bm, Cm))
    slots = slot_ids.to(torch.int64).contiguous()
    y = torch.empty_like(u)
    if library().mamba_rows(decay.data_ptr(), u.data_ptr(), Bm.data_ptr(), Cm.data_ptr(), ssm_state.data_ptr(),
                            ssm_state.shape[0], ssm_state.stride(0), slots.data_ptr(), ssm_stash.data_ptr(),
                            y.data_ptr(), Bsz, K, H, G, P, N):
        raise ValueError(f"mamba_rows: slot_ids {slots.tolist()} must lie in [0, {ssm_state.shape[0]})")
    return y


def pack_rows(weight: Tensor) -> Tensor:
    """weight (N, K), any layout -> its packed fp32 copy (ceil(N / NB), K, NB) for rows_mm: block j holds output
    columns j NB .. j NB + NB - 1, contiguous, zeros past N."""
    NB, (N, K) = library().block, weight.shape
    packed = torch.zeros(-(-N // NB) * NB, K, dtype=torch.float32, device=weight.device)
    packed[:N] = weight.detach()
    return packed.view(-1, NB, K).transpose(1, 2).contiguous()


def rows_mm(x: Tensor, packed: Tensor, n: int) -> Tensor:
    """x (M, K) fp32 times the weight (n, K) that pack_rows packed -> y = x W^T (M, n) fp32, one thread."""
    lib = library()
    fits = x.dim() == 2 and packed.shape[1:] == (x.shape[1], lib.block) and packed.is_contiguous()
    if not fits or x.dtype != torch.float32 or packed.dtype != torch.float32 or not 0 < n <= packed[:, 0].numel():
        raise ValueError(f"rows_mm: x {tuple(x.shape)} {x.dtype} does not fit the packed weight {tuple(packed.shape)} "
                         f"{packed.dtype} of {n} rows")
    x = x.contiguous()
    y = x.new_empty(x.shape[0], n)
    lib.rows_mm(x.data_ptr(), packed.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], n)
    return y


LIB = torch.library.Library("nano_spec", "FRAGMENT")  # holds the ops below: dropped, it would unregister them


def library_op(schema: str, meta=lambda *args: None):
    """fn as the operator nano_spec::<schema>: the dispatcher calls fn straight (a call costs about half what
    torch.library.custom_op's does: 25 against 52 us, measured; these ops need none of its autograd and
    default-argument layers). A write op's writes are in its schema, so a graph hands it the cache views and it
    writes in place; traced, an op runs nothing and returns meta(*args), its new outputs (None for a write op)."""
    def register(fn):
        name = schema.split("(")[0]
        LIB.define(schema)
        LIB.impl(name, fn, "CompositeExplicitAutograd")
        LIB.impl(name, meta, "Meta")
        return getattr(torch.ops.nano_spec, name).default
    return register


ROWS_MAX = 16  # rows up to which rows_mm beats ATen's GEMM on one thread (docs/BENCHMARKS.md, "K rows")


def runs_in_c(rows: int) -> bool:
    """Whether a product of this many rows by a packed weight runs in rows_mm: at most ROWS_MAX rows, one thread."""
    return rows <= ROWS_MAX and torch.get_num_threads() == 1


@library_op("rows_linear(Tensor x, Tensor packed, Tensor weight) -> Tensor",
            meta=lambda x, packed, weight: x.new_empty(x.shape[0], weight.shape[0]))
def rows_linear(x: Tensor, packed: Tensor, weight: Tensor) -> Tensor:
    """x (M, K) W^T -> (M, N) for the weight (N, K) and its packed copy. rows_mm runs on one thread: at more, the
    call is ATen's GEMM over the weight, which uses them (the thread count may change between calls of a graph)."""
    return rows_mm(x, packed, weight.shape[0]) if runs_in_c(x.shape[0]) else F.linear(x, weight)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), over the packed copy of the weight where there is one and x has at most ROWS_MAX
    rows (a compiled CPU step's; a prompt's rows go to ATen's GEMM)."""
    rows = x.numel() // x.shape[-1]
    if packed is None or rows > ROWS_MAX:
        return F.linear(x, weight, bias)
    y = rows_linear(x.reshape(rows, x.shape[-1]), packed, weight).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class RowsLinear(nn.Module):
    """An nn.Linear's weight and bias (the same tensors under the same names) with a packed copy of the weight."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self.register_buffer("packed", pack_rows(lin.weight), persistent=False)

    def forward(self, x):
        return linear(x, self.weight, self.bias, self.packed)


def pack_linears(net: nn.Module):
    """Every fp32 weight of net that a step multiplies gets its packed copy: its nn.Linear layers become RowsLinear,
    and a module that multiplies a weight itself names it in `packs`, (weight attribute, its packed buffer) pairs
    (layers.Attention's fused q/k/v, the target's tied output layer). Other dtypes keep ATen's GEMM."""
    if next(net.parameters()).dtype != torch.float32:
        return
    for module in list(net.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, RowsLinear(child))
        for weight, packed in getattr(module, "packs", ()):
            if getattr(module, weight) is not None:
                setattr(module, packed, pack_rows(getattr(module, weight)))
