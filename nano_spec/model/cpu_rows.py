"""The K-row Mamba recurrence of a verify on the CPU, in C (docs/DESIGN.md §12, "The K-row recurrence").

For each sequence b and head h of group g = h // (H/G), over the rows k = 1..K of the step:

    S_k = a_k S_{k-1} + u_k ⊗ B_k          S (P, N) fp32, a_k = exp(dt_k A), u_k = dt_k x_k (P,)
    stash[b, k-1] = S_k;  y_k = S_k C_k    (P,);  the slot's state becomes S_K

Written as torch ops in a compiled graph, each row's state went to a buffer, was read back for y, and copied
again into the stash: about 4x the bytes of the state per row. Here one head's state (16 KB at the 350m shape)
stays in L1 across the K rows and each row's state is written once, into the stash. The state's arithmetic is
the torch reference's (a*S rounded, u*B rounded, then the sum: no fused multiply-add), so the stash and the
state equal mamba_verify_ref's bit for bit; y sums over N in a fixed order of its own, the same at any K.
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
    path = cache / f"mamba_rows_{key}.so"
    if not path.exists():
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then moved in whole
            src, out = Path(tmp) / "mamba_rows.c", Path(tmp) / "mamba_rows.so"
            src.write_text(SOURCE)
            done = subprocess.run([cc, *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"compile: {cc} could not build the CPU Mamba kernel:\n{done.stderr[-2000:]}")
            os.replace(out, path)
    lib = ctypes.CDLL(str(path))
    pointers, sizes = ctypes.c_void_p, ctypes.c_int64  # the return type is ctypes' default, a C int
    lib.mamba_rows.argtypes = [pointers] * 5 + [sizes] * 2 + [pointers] * 3 + [sizes] * 6
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
