// The CPU kernels of the nano_spec:: operators a compiled CPU step calls (docs/DESIGN.md §12). cpu_rows.py builds
// this file once per machine and torch, and explains the math; the schemas and meta functions are in Python
// (cpu_rows.py, graph_ops.py). A kernel here costs ~1.6 us of dispatch from a graph, a Python one ~10.
#include <ATen/Parallel.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

using at::Tensor;

namespace {

// Vectors of 16 lanes (the compiler's vector extension; AVX-512 registers, two AVX2 ones), and a sum in a fixed order
typedef float lanes __attribute__((vector_size(64), aligned(4)));      // 16 fp32, loaded unaligned
typedef float lanes8 __attribute__((vector_size(32)));
typedef uint16_t lanes16 __attribute__((vector_size(32), aligned(2)));  // 16 bf16
typedef uint32_t lanes32 __attribute__((vector_size(64)));
typedef int32_t ints __attribute__((vector_size(64)));
inline lanes load16(const float *p) { return *(const lanes *)p; }
inline void stream16(float *p, lanes v) {  // a store that passes the caches by (p 64-byte aligned)
#ifdef __AVX512F__
  __m512 m;
  std::memcpy(&m, &v, sizeof m);
  _mm512_stream_ps(p, m);
#else
  *(lanes *)p = v;
#endif
}
inline float sum16(lanes v) {  // halves added as a tree: a fixed order, 4 steps deep
  lanes8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, (char *)&v + sizeof lo, sizeof hi);
  lanes8 a = lo + hi;
  float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
  return (b0 + b2) + (b1 + b3);
}

// ---- 1. the K-row recurrence ---------------------------------------------------------------------------------
// Sequence b's head h (group g) over its K rows: S_k = a_k S_{k-1} + u_k B_k, y_k = S_k C_k. Row k's state goes to
// the stash's row k (stash), or over the state itself (stash null: a prompt's scan, in place); the last row's to
// `last` if given (a verify's live state, written in place: no commit reads the stash's last row). With `run` (P N
// floats), the stash rows are streamed (stream16) and the state between rows lives in run. Row bk's G N values of B
// and C start at bk * row (views of a step's xBC rows are read where they lie).
void mamba_head(const float *decay, const float *u, const float *Bm, const float *Cm, int64_t row, float *state_h,
                float *stash, float *last, float *run, float *y, int64_t b, int64_t h, int64_t K, int64_t H, int64_t G,
                int64_t P, int64_t N) {
  const float *prev = state_h;
  int64_t g = h / (H / G);
  for (int64_t k = 0; k < K; k++) {  // row k reads row k-1's state, still in L1
    int64_t bk = b * K + k;
    float a = decay[bk * H + h];
    float *out = k == K - 1 && last ? last : stash ? stash + (bk * H + h) * P * N : state_h;
    bool streamed = run && stash && out != last;  // a stash row past the caches, the state kept in run
    float *keep = streamed ? run : out;
    const float *Bn = Bm + bk * row + g * N, *Cn = Cm + bk * row + g * N;
    for (int64_t p = 0; p < P; p++) {
      float up = u[(bk * H + h) * P + p];
      const float *s = prev + p * N;
      float *o = keep + p * N, *so = out + p * N;
      lanes acc = {};
      int64_t n = 0;
      for (; n + 16 <= N; n += 16) {
        lanes v = a * load16(s + n) + up * load16(Bn + n);
        *(lanes *)(o + n) = v;
        if (streamed) stream16(so + n, v);
        acc += v * load16(Cn + n);
      }
      float sum = sum16(acc);
      for (; n < N; n++) {  // a streamed row has none (mamba_rows streams only where N % 16 == 0)
        float v = a * s[n] + up * Bn[n];
        o[n] = v;
        sum += v * Cn[n];
      }
      y[(bk * H + h) * P + p] = sum;
    }
    prev = keep;
  }
}

// A verify's rows: every sequence b's heads, rows 0..K-2 into the stash, the last row over the live state. A padded
// batch repeats a slot, and every row must read the state before the step: then all K rows go to the stash and
// the live states are written last, from it. A commit reads at most one stash row a sequence, so stash rows of
// STREAM_BYTES or more a call are streamed past the caches (the state between rows kept in `run`, in L1): written
// through the caches they would push the weights out of the last-level cache that the next step reads them from
// (batch 8, γ = 3: 3 MB a layer; docs/DESIGN.md §12)
#define STREAM_BYTES (2 << 20)
void mamba_rows(const float *decay, const float *u, const float *Bm, const float *Cm, int64_t row, float *state,
                int64_t slot_stride, const int64_t *slots, float *stash, float *y,
                int64_t nb, int64_t K, int64_t H, int64_t G, int64_t P, int64_t N) {
  bool repeats = false;
  for (int64_t b = 0; b < nb; b++)
    for (int64_t e = 0; e < b; e++) repeats |= slots[e] == slots[b];
  bool stream = !repeats && N % 16 == 0 && reinterpret_cast<uintptr_t>(stash) % 64 == 0 &&
                nb * (K - 1) * H * P * N * 4 >= STREAM_BYTES;
  std::vector<float> run(stream ? P * N : 0);
  for (int64_t b = 0; b < nb; b++)
    for (int64_t h = 0; h < H; h++) {
      float *state_h = state + slots[b] * slot_stride + h * P * N;
      mamba_head(decay, u, Bm, Cm, row, state_h, stash, repeats ? nullptr : state_h, stream ? run.data() : nullptr,
                 y, b, h, K, H, G, P, N);
    }
#ifdef __AVX512F__
  if (stream) _mm_sfence();
#endif
  if (repeats)
    for (int64_t b = 0; b < nb; b++)
      std::memcpy(state + slots[b] * slot_stride, stash + ((b * K + K - 1) * H) * P * N,
                  H * P * N * sizeof(float));
}

// ---- 2. few rows by a packed weight ----------------------------------------------------------------------------
// MB rows per pass over a block: their 2 MB sums, the block's two weight vectors and a row's input share the
// vector registers. A pass of few rows is bound by its sums' add latency, not by reading the block, so a step's
// K rows (up to MB) go in one pass: a second pass of 1 row over blocks already in cache costs more than the first.
// Up to PAIR_ROWS rows go over two blocks at once: twice the independent sums, two streams of weights in flight
// (a step's products: ~8 % off at 1 and 4 rows, ~20 % at 5 and 6), and each column's sums unchanged
#ifdef __AVX512F__
#define NB 32  // a block's output columns: two vectors of 16 lanes
#define MB 8   // 32 registers
#define PAIR_ROWS 6
#else
#define NB 16  // 16 vector registers (AVX2, NEON)
#define MB 4
#define PAIR_ROWS 2
#endif
typedef float half __attribute__((vector_size(NB * 2), aligned(4)));  // NB / 2 fp32 lanes, loaded unaligned

// A packed block's row k as two vectors of fp32 lanes: columns 0 .. NB/2-1 and NB/2 .. NB-1. An fp32 block holds
// them; an int8 block (a drafter's) holds them as int8, each column scaled by its own factor: the block's rows are
// followed by its NB columns' scales (fp32, in TAIL rows of NB bytes), and a column's sums over the int8 values
// take one product by its scale at the end
inline void load_row(const float *w, half &w0, half &w1) {
  w0 = *(const half *)w;
  w1 = *(const half *)(w + NB / 2);
}
inline void load_row(const int8_t *w, half &w0, half &w1) {  // sign-extended to int32, then converted
#ifdef __AVX512F__
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + NB / 2))));
  std::memcpy(&w0, &lo, sizeof w0);
  std::memcpy(&w1, &hi, sizeof w1);
#else
  for (int i = 0; i < NB / 2; i++) {
    w0[i] = w[i];
    w1[i] = w[i + NB / 2];
  }
#endif
}
template <class W> constexpr int64_t TAIL = std::is_same_v<W, int8_t> ? sizeof(float) : 0;

// mb rows of x (mb, Kd) times nbk consecutive packed blocks w (nbk, Kd, NB) -> y (mb, ..), the last block's
// columns cut to n <= NB: each row's sums over k in order, each term fused into its sum (one rounding, in every
// pass alike; the recurrence above has none, for its reference)
#if defined(__GNUC__) && !defined(__clang__)
#define FUSED __attribute__((optimize("fp-contract=fast")))
#else
#define FUSED  // clang: the products and sums stay apart, slower but the same in every pass
#endif
template <int mb, int nbk, class W>
FUSED void rows_pass(const float *x, const W *w, float *y, int64_t Kd, int64_t N, int64_t n) {
  half acc[nbk][mb][2] = {};
  const int64_t stride = (Kd + TAIL<W>) * NB;  // one block's
  for (int64_t k = 0; k < Kd; k++)
    for (int b = 0; b < nbk; b++) {
      half w0, w1;
      load_row(w + b * stride + k * NB, w0, w1);
      for (int m = 0; m < mb; m++) {
        float xm = x[m * Kd + k];
        acc[b][m][0] += xm * w0;
        acc[b][m][1] += xm * w1;
      }
    }
  if constexpr (TAIL<W> > 0)
    for (int b = 0; b < nbk; b++) {
      const float *scale = reinterpret_cast<const float *>(w + b * stride + Kd * NB);
      half s0 = *(const half *)scale, s1 = *(const half *)(scale + NB / 2);
      for (int m = 0; m < mb; m++) {
        acc[b][m][0] *= s0;
        acc[b][m][1] *= s1;
      }
    }
  for (int b = 0; b < nbk; b++)
    for (int m = 0; m < mb; m++)  // the NB sums, the last block's cut to n
      std::memcpy(y + m * N + b * NB, acc[b][m], (b == nbk - 1 ? n : NB) * sizeof(float));
}

// mb rows (1 .. MB; up to PAIR_ROWS over two blocks) over nbk blocks: the pass unrolled for that count
template <int nbk, int m = 1, class W>
void rows_passes(int mb, const float *x, const W *w, float *y, int64_t Kd, int64_t N, int64_t n) {
  if constexpr (m < (nbk == 1 ? MB : PAIR_ROWS))
    if (mb > m) return rows_passes<nbk, m + 1>(mb, x, w, y, Kd, N, n);
  rows_pass<m, nbk>(x, w, y, Kd, N, n);
}

// y (M, N) = x (M, Kd) @ the packed weight (ceil(N / NB), Kd, NB); a block stays in cache across the row passes.
// The blocks are shared out over torch's threads (one runs them all inline): a column's sums are the same whichever
// thread makes them, and whether its block goes alone or in a pair
template <class W>
void rows_mm_loop(const float *x, const W *w, float *y, int64_t M, int64_t Kd, int64_t N) {
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last;) {
      int64_t n0 = j * NB, n = N - n0 < NB ? N - n0 : NB;
      bool pair = j + 1 < last && n0 + 2 * NB <= N;  // two whole blocks
      const W *block = w + j * (Kd + TAIL<W>) * NB;
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        int mb = M - m0 < MB ? M - m0 : MB;
        const float *xm = x + m0 * Kd;
        float *ym = y + m0 * N + n0;
        if (pair && mb <= PAIR_ROWS) {
          rows_passes<2>(mb, xm, block, ym, Kd, N, NB);
        } else {
          rows_passes<1>(mb, xm, block, ym, Kd, N, n);
          if (pair) rows_passes<1>(mb, xm, block + (Kd + TAIL<W>) * NB, ym + NB, Kd, N, NB);
        }
      }
      j += pair ? 2 : 1;
    }
  });
}

// ---- 3. attention of a step's rows over a slot's cache ------------------------------------------------------------
// Query row (b, j), head h (KV head h / rep) sees the slot's cache rows 0 .. pos[b, j] and then the E rows of its
// sequence's own (a block drafter's block: E = 0 for a verify, whose rows are in the cache by then):
//     s_l = scale q.k_l,   e_l = exp(s_l - max s),   o = (sum_l e_l v_l) / sum_l e_l
// over exactly those rows, whatever the cache's length. The query rows that read one KV head of one sequence (its
// K rows times the head's rep query heads) go through the rows together, 16 at a time, so a block of keys or values
// comes from memory once and then from L1 for each of them. Yet each row's sums run over its own rows in one order,
// fixed by the rows' indices alone, so a row comes out the same, bit for bit, in a 1-row and in a K-row call (and
// in any batch). The head dim Dh is nv vectors of 16 lanes and a rest of fewer, nv <= ATTEND_DV; the common head
// dims (64, 128) have their loops unrolled at compile time, any other runs the same code with nv read at run time.
#define ATTEND_DV 16  // Dh up to 16 * 17 - 1
#define KEYS 16       // rows a block: one vector of scores
inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // a bf16 value is the top half of its fp32
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(c10::Half v) { return float(v); }
inline lanes load16(const c10::Half *p) {
  lanes f;
  for (int i = 0; i < 16; i++) f[i] = float(p[i]);
  return f;
}
inline lanes load16(const uint16_t *p) {
  lanes32 bits = __builtin_convertvector(*(const lanes16 *)p, lanes32) << 16;
  lanes f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 dot products' lanes summed at once, lane i the sum of d[i]'s 16 lanes, in sum16's tree (halves, quarters, ..):
// a transpose in four rounds of shuffles instead of a horizontal sum per row
inline lanes sum16x16(const lanes *d) {
  lanes t[8], u[4], w[2];
  for (int i = 0; i < 8; i++) {  // lanes l and l + 8 of two rows: their 8 sums side by side
    const lanes &a = d[2 * i], &b = d[2 * i + 1];
    t[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; i++) {  // then l and l + 4: 4 sums a row, four rows
    const lanes &a = t[2 * i], &b = t[2 * i + 1];
    u[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; i++) {  // then l and l + 2: 2 sums a row, eight rows
    const lanes &a = u[2 * i], &b = u[2 * i + 1];
    w[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// exp(x) in 16 lanes, within ~2 ulp, for x <= 0 (a score less its row's top): 2^n exp(r) with n = round(x log2 e)
// and r = x - n ln 2 (ln 2 in two parts), exp(r) by Cephes' expf polynomial, 2^n made in the exponent bits. Below
// -87, where exp leaves fp32's normal range, 0: next to the top row's 1 such a weight adds nothing.
inline lanes exp16(lanes x) {
  const lanes zero = {}, low = zero - 87.0f, round = zero + 12582912.0f;  // 1.5 * 2^23: adding it rounds
  ints under = x < low;
  x = under ? low : x;
  lanes n = (x * 1.44269504f + round) - round;
  lanes r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  lanes p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * (r * r) + r) + 1.0f;
  ints bits = (__builtin_convertvector(n, ints) + 127) << 23;
  lanes two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return under ? zero : p * two_n;
}

// The rows the query rows of one (sequence, KV head) see, in two runs row_stride apart: the cache's, of which row r
// sees count[r], then the sequence's own, E, which every row sees after its cache rows
template <class T>
struct Seen {
  const T *keys[2], *vals[2];
  int64_t E, row_stride;
};

// Every block of up to KEYS rows that query row r sees, blocks in order and, within one, rows r in order: first the
// cache's (part 0, count[r] rows), then the sequence's own (part 1, E). f(r, part, l0, m, at): the block's first row
// l0 within its part, its m rows, the index of its first score among the row's
template <class T, class F>
inline void each_block(const int64_t *count, int64_t R, const Seen<T> &seen, F f) {
  for (int part = 0; part < 2; part++) {
    int64_t most = part ? seen.E : 0;
    for (int64_t r = 0; r < R && !part; r++) most = count[r] > most ? count[r] : most;
    for (int64_t l0 = 0; l0 < most; l0 += KEYS)
      for (int64_t r = 0; r < R; r++) {
        int64_t m = (part ? seen.E : count[r]) - l0;
        if (m > 0) f(r, part, l0, m < KEYS ? m : KEYS, part ? count[r] + l0 : l0);
      }
  }
}

// R query rows (q_rows[r]: its Dh values, o_rows[r]: its output) over the rows they see: their scores block by block
// (scores: R rows of span), each row's e_l and total, then their outputs block by block (acc: R rows of Dh)
template <int DV, class T>
FUSED void attend_group(const float *const *q_rows, float *const *o_rows, const int64_t *count, int64_t R,
                        const Seen<T> &seen, int64_t Dh, float scale, float *scores, int64_t span, float *acc) {
  constexpr int NV = DV > 0 ? DV : ATTEND_DV;
  const int nv = DV > 0 ? DV : int(Dh / 16);  // DV: the vectors known when compiled, 0: read at run time
  const lanes zero = {};
  // 1. s_l = scale q.k_l: Dh's vectors, their 16 lanes as a tree, the rest
  each_block(count, R, seen, [&](int64_t r, int part, int64_t l0, int64_t m, int64_t at) FUSED {
    const float *q = q_rows[r];
    const T *k = seen.keys[part] + l0 * seen.row_stride;
    lanes d[KEYS], qv[NV];
    float s[KEYS];
    for (int v = 0; v < nv; v++) qv[v] = load16(q + 16 * v);
    if (m == KEYS) {  // a whole block: its 16 sums unrolled in registers
#pragma GCC unroll 16
      for (int i = 0; i < KEYS; i++) {
        d[i] = zero;
        for (int v = 0; v < nv; v++) d[i] += qv[v] * load16(k + i * seen.row_stride + 16 * v);
      }
    } else {
      for (int i = 0; i < KEYS; i++) {  // rows past the block's m: zeros, their sums unused
        d[i] = zero;
        if (i < m)
          for (int v = 0; v < nv; v++) d[i] += qv[v] * load16(k + i * seen.row_stride + 16 * v);
      }
    }
    lanes sums = nv > 0 ? sum16x16(d) : zero;
    std::memcpy(s, &sums, sizeof s);
    float *out = scores + r * span + at;
    for (int i = 0; i < m; i++) {
      for (int64_t c = 16 * nv; c < Dh; c++) s[i] += q[c] * widen(k[i * seen.row_stride + c]);
      out[i] = s[i] * scale;
    }
  });
  for (int64_t r = 0; r < R; r++) {  // 2. e_l = exp(s_l - top) over the row's scores, and their total
    float *s = scores + r * span, top = -INFINITY;
    int64_t n = count[r] + seen.E, l = 0;
    lanes tops = zero - INFINITY;  // the max in 16 lanes, then over them: any order gives the same max
    for (; l + KEYS <= n; l += KEYS) tops = tops > load16(s + l) ? tops : load16(s + l);
    for (int i = 0; i < KEYS; i++) top = tops[i] > top ? tops[i] : top;
    for (; l < n; l++) top = s[l] > top ? s[l] : top;
    lanes total = zero;
    for (l = 0; l < n; l += KEYS) {
      lanes x;
      if (n - l >= KEYS) {
        x = load16(s + l);
      } else {  // the last rows, the lanes past them -inf (their e 0)
        float tail[KEYS];
        for (int i = 0; i < KEYS; i++) tail[i] = l + i < n ? s[l + i] : -INFINITY;
        std::memcpy(&x, tail, sizeof x);
      }
      lanes e = exp16(x - top);
      total += e;
      std::memcpy(s + l, &e, (n - l < KEYS ? n - l : KEYS) * sizeof(float));
    }
    float *a = acc + r * (Dh + 1);
    std::fill(a, a + Dh, 0.0f);
    a[Dh] = sum16(total);  // acc's rows are Dh + 1 long: the total last
  }
  // 3. o = sum_l e_l v_l: even and odd rows of a block summed apart, then added
  each_block(count, R, seen, [&](int64_t r, int part, int64_t l0, int64_t m, int64_t at) FUSED {
    const float *e = scores + r * span + at;
    const T *val = seen.vals[part] + l0 * seen.row_stride;
    float *a = acc + r * (Dh + 1);
    lanes even[NV], odd[NV];
    for (int v = 0; v < nv; v++) even[v] = odd[v] = zero;
    int i = 0;
#pragma GCC unroll 8
    for (; i + 1 < m; i += 2)
      for (int v = 0; v < nv; v++) {
        even[v] += e[i] * load16(val + i * seen.row_stride + 16 * v);
        odd[v] += e[i + 1] * load16(val + (i + 1) * seen.row_stride + 16 * v);
      }
    for (; i < m; i++)
      for (int v = 0; v < nv; v++) even[v] += e[i] * load16(val + i * seen.row_stride + 16 * v);
    for (int v = 0; v < nv; v++) *(lanes *)(a + 16 * v) = load16(a + 16 * v) + (even[v] + odd[v]);
    for (int64_t c = 16 * nv; c < Dh; c++)
      for (int j = 0; j < m; j++) a[c] += e[j] * widen(val[j * seen.row_stride + c]);
  });
  for (int64_t r = 0; r < R; r++) {  // 4. o = acc / total
    const float *a = acc + r * (Dh + 1);
    for (int64_t c = 0; c < Dh; c++) o_rows[r][c] = a[c] / a[Dh];
  }
}

// Every query row of the step, grouped by (sequence, KV head), the groups shared out over torch's threads (a row's
// sums are the same whichever thread makes them), each thread with its own scores and sums (span: the most rows a
// query sees); q read through its strides, o (B, K, Hq, Dh) contiguous
template <class T>
void attend_rows(const float *q, const int64_t *q_strides, const T *kc, const T *vc, const T *own_k, const T *own_v,
                 const int64_t *slots, const int64_t *pos, float *o, int64_t nb, int64_t K, int64_t E, int64_t Hq,
                 int64_t Hkv, int64_t Dh, int64_t slot_stride, int64_t row_stride, float scale, int64_t span) {
  auto group = Dh / 16 == 4 ? attend_group<4, T> : Dh / 16 == 8 ? attend_group<8, T> : attend_group<0, T>;
  int64_t rep = Hq / Hkv, R = K * rep;
  at::parallel_for(0, nb * Hkv, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(R * span), acc(R * (Dh + 1));
    std::vector<const float *> q_rows(R);
    std::vector<float *> o_rows(R);
    std::vector<int64_t> count(R);
    for (int64_t item = first; item < last; item++) {  // item = b Hkv + g
      int64_t b = item / Hkv, g = item % Hkv, head = slots[b] * slot_stride + g * Dh;
      int64_t own = (b * E * Hkv + g) * Dh;  // the sequence's own rows: (B, E, Hkv, Dh), contiguous
      for (int64_t r = 0; r < R; r++) {  // row r: query row j = r / rep, head g rep + r % rep
        int64_t j = r / rep, h = g * rep + r % rep, at = (b * K + j) * Hq + h;
        q_rows[r] = q + b * q_strides[0] + j * q_strides[1] + h * q_strides[2];  // q (B, K, Hq, Dh), Dh's stride 1
        o_rows[r] = o + at * Dh;
        count[r] = pos[b * K + j] + 1;
      }
      Seen<T> seen{{kc + head, E ? own_k + own : nullptr}, {vc + head, E ? own_v + own : nullptr}, E, row_stride};
      group(q_rows.data(), o_rows.data(), count.data(), R, seen, Dh, scale, scores.data(), span, acc.data());
    }
  });
}

// ---- the operators -----------------------------------------------------------------------------------------------
// C conv rows of W-1 values (es bytes each) into dst (C, W-1), from src (C, width), columns col .. col+W-2: a slot's
// conv window out of a window of width W-1+K
void copy_window(char *dst, const char *src, int64_t C, int64_t Wm1, int64_t width, int64_t col, int64_t es) {
  for (int64_t c = 0; c < C; c++) std::memcpy(dst + c * Wm1 * es, src + (c * width + col) * es, Wm1 * es);
}

// Whether each row of t (its last `dims` dims) lies contiguous, the rows any stride apart
bool rows_dense(const Tensor &t, int dims) {
  int64_t dense = 1;  // a dense row's stride at dim d: the product of the sizes after it
  for (int64_t d = t.dim() - 1; d >= t.dim() - dims; d--) {
    if (t.size(d) != 1 && t.stride(d) != dense) return false;
    dense *= t.size(d);
  }
  return true;
}

// t itself where its rows are dense (views of a step's fused products are read where they lie); else a contiguous
// copy
Tensor dense_rows(const Tensor &t, int dims) { return rows_dense(t, dims) ? t : t.contiguous(); }

void check_slots(const char *op, const Tensor &slots, int64_t num_slots) {
  const int64_t *s = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < slots.numel(); b++)
    TORCH_CHECK_VALUE(0 <= s[b] && s[b] < num_slots, op, ": slot ", s[b], " (row ", b, ") must lie in [0, ", num_slots,
                      ")");
}

int64_t rows_block() { return NB; }

Tensor rows_mm(const Tensor &x, const Tensor &packed, int64_t n) {
  bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && (packed.scalar_type() == at::kFloat || int8) &&
                        packed.dim() == 3 && packed.size(1) == x.size(1) + (int8 ? TAIL<int8_t> : 0) &&
                        packed.size(2) == NB && packed.is_contiguous() && 0 < n && n <= packed.size(0) * NB,
                    "rows_mm: x ", x.sizes(), " ", x.scalar_type(), " does not fit the packed weight ", packed.sizes(),
                    " ", packed.scalar_type(), " of ", n, " rows");
  Tensor xc = x.contiguous(), y = at::empty({x.size(0), n}, x.options());
  if (int8)
    rows_mm_loop(xc.data_ptr<float>(), packed.data_ptr<int8_t>(), y.data_ptr<float>(), x.size(0), x.size(1), n);
  else
    rows_mm_loop(xc.data_ptr<float>(), packed.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1), n);
  return y;
}

// the weight (n, K) fp32 that an int8 copy holds: each column's int8 values times its scale
Tensor rows_weight(const Tensor &packed, int64_t n) {
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == NB &&
                        packed.size(1) > TAIL<int8_t> && 0 < n && n <= packed.size(0) * NB,
                    "rows_weight: ", packed.sizes(), " ", packed.scalar_type(), " is not an int8 copy of ", n, " rows");
  int64_t nb = packed.size(0), K = packed.size(1) - TAIL<int8_t>;
  Tensor scale = packed.narrow(1, K, TAIL<int8_t>).reshape({nb, TAIL<int8_t> * NB}).view(at::kFloat);  // (nb, NB)
  return packed.narrow(1, 0, K).to(at::kFloat).mul(scale.unsqueeze(1)).transpose(1, 2).reshape({nb * NB, K})
      .narrow(0, 0, n);
}

// a drafter's int8 copy serves a step's rows at any thread count, and its weight is read at int8 precision on
// ATen's path too (a prompt's rows): the compiled drafter computes one function whatever the rows and threads
Tensor rows_linear(const Tensor &x, const Tensor &packed, const Tensor &weight) {
  bool int8 = packed.scalar_type() == at::kChar;
  bool in_c = int8 ? x.size(0) <= DRAFT_ROWS_MAX : x.size(0) <= ROWS_MAX && at::get_num_threads() == 1;  // runs_in_c
  if (in_c) return rows_mm(x, packed, weight.size(0));
  return at::linear(x, int8 ? rows_weight(packed, weight.size(0)) : weight);
}

// The stride between the rows of t (.., G, N), each row's G N values together, the rows (its leading dims, in order)
// one stride apart; -1 where they do not lie so. Read off the strides: a reshape would cost a dispatch a call.
int64_t row_stride(const Tensor &t) {
  if (!rows_dense(t, 2)) return -1;
  int64_t row = 0, next = 0;  // the row stride; the stride the next leading dim out must have
  for (int64_t d = t.dim() - 3; d >= 0; d--) {
    if (t.size(d) == 1) continue;
    if (t.stride(d) <= 0 || (row && t.stride(d) != next)) return -1;  // an expanded dim (stride 0) too
    row = row ? row : t.stride(d);
    next = t.stride(d) * t.size(d);
  }
  return row ? row : t.size(-2) * t.size(-1);  // rows of one: any stride serves
}

// B and C (.., G, N) fp32 with one row stride (returned): views of a step's xBC rows are read where they lie,
// anything else copied first
std::tuple<Tensor, Tensor, int64_t> bc_rows(const Tensor &B, const Tensor &C) {
  Tensor b = B.to(at::kFloat), c = C.to(at::kFloat);
  int64_t row = row_stride(b);
  if (row == -1 || row_stride(c) != row) {
    b = b.contiguous(), c = c.contiguous();
    row = B.size(-2) * B.size(-1);
  }
  return {b, c, row};
}

Tensor mamba_write(const Tensor &conv_state, const Tensor &ssm_state, const Tensor &conv_stash,
                   const Tensor &ssm_stash, const Tensor &slot_ids, const Tensor &window, const Tensor &decay,
                   const Tensor &u, const Tensor &B, const Tensor &C) {
  int64_t nb = u.size(0), K = u.size(1), H = u.size(2), P = u.size(3), G = B.size(2), N = B.size(3);
  int64_t S = ssm_state.size(0), Cc = window.size(1), Wm1 = conv_state.size(2);
  bool state_ok = ssm_state.dim() == 4 && ssm_state.size(1) == H && ssm_state.size(2) == P &&
                  ssm_state.size(3) == N && ssm_state.stride(1) == P * N && ssm_state.stride(2) == N &&
                  ssm_state.stride(3) == 1;
  TORCH_CHECK_VALUE(ssm_state.scalar_type() == at::kFloat && ssm_stash.scalar_type() == at::kFloat && state_ok &&
                        ssm_stash.sizes() == at::IntArrayRef({nb, K, H, P, N}) && ssm_stash.is_contiguous(),
                    "mamba_write: ssm_state must be fp32 (S, H, P, N) with contiguous slots, and ssm_stash a "
                    "contiguous fp32 (B, K, H, P, N)");
  TORCH_CHECK_VALUE(conv_state.dim() == 3 && conv_state.size(1) == Cc && conv_state.stride(1) == Wm1 &&
                        conv_state.stride(2) == 1 && conv_state.size(0) == S &&
                        window.sizes() == at::IntArrayRef({nb, Cc, Wm1 + K}) && conv_stash.is_contiguous() &&
                        conv_stash.sizes() == window.sizes() && window.scalar_type() == conv_state.scalar_type() &&
                        conv_stash.scalar_type() == conv_state.scalar_type(),
                    "mamba_write: conv_state must be (S, C, W-1) with contiguous slots, and window and conv_stash "
                    "(B, C, W-1+K), conv_stash contiguous, all of one dtype");
  TORCH_CHECK_VALUE(u.dim() == 4 && B.dim() == 4 && slot_ids.numel() == nb &&
                        decay.sizes() == at::IntArrayRef({nb, K, H}) && B.sizes() == C.sizes() && B.size(0) == nb &&
                        B.size(1) == K && G > 0 && H % G == 0,
                    "mamba_write: slot_ids (B,), decay (B, K, H), u (B, K, H, P), and B and C (B, K, G, N) with G "
                    "dividing H");
  Tensor slots = slot_ids.to(at::kLong).contiguous();
  check_slots("mamba_write", slots, S);  // before anything is written
  Tensor d = decay.to(at::kFloat).contiguous(), uc = u.to(at::kFloat).contiguous(), win = window.contiguous();
  auto [Bc, Cm, row] = bc_rows(B, C);
  Tensor y = at::empty({nb, K, H, P}, u.options().dtype(at::kFloat));
  mamba_rows(d.data_ptr<float>(), uc.data_ptr<float>(), Bc.data_ptr<float>(), Cm.data_ptr<float>(), row,
             ssm_state.data_ptr<float>(), ssm_state.stride(0), slots.data_ptr<int64_t>(),
             ssm_stash.data_ptr<float>(), y.data_ptr<float>(), nb, K, H, G, P, N);
  // the conv: the window into the stash, its last W-1 columns into the slot
  int64_t es = win.element_size(), W = Wm1 + K;
  const char *src = static_cast<const char *>(win.data_ptr());
  char *state = static_cast<char *>(conv_state.data_ptr());
  std::memcpy(conv_stash.data_ptr(), src, win.numel() * es);
  for (int64_t b = 0; b < nb; b++)
    copy_window(state + slots.data_ptr<int64_t>()[b] * conv_state.stride(0) * es, src + b * Cc * W * es, Cc, Wm1, W,
                K, es);
  return y;
}

Tensor conv_rows(const Tensor &x, const Tensor &weight, const std::optional<Tensor> &bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && weight.size(0) == x.size(1) &&
                        (!bias || (bias->dim() == 1 && bias->size(0) == x.size(1))),
                    "conv_rows: x must be (T, C), weight (C, W) and bias (C,)");
  int64_t T = x.size(0), C = x.size(1), W = weight.size(1);
  // a prompt's xBC rows and the taps' rows (W, C) read where they lie when each row's C values are together
  Tensor xf = dense_rows(x.to(at::kFloat), 1), wt = dense_rows(weight.to(at::kFloat).t(), 1);
  int64_t xs = xf.stride(0), ws = wt.stride(0);
  Tensor bf = bias ? bias->to(at::kFloat).contiguous() : Tensor();
  Tensor y = at::zeros({T, C}, x.options().dtype(at::kFloat));
  const float *xp = xf.data_ptr<float>(), *wp = wt.data_ptr<float>(), *bp = bias ? bf.data_ptr<float>() : nullptr;
  float *yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) {
      float *o = yp + t * C;
      for (int64_t k = std::max<int64_t>(0, W - 1 - t); k < W; k++) {  // tap k reads row t - (W-1) + k; none before 0
        const float *xi = xp + (t - W + 1 + k) * xs, *wk = wp + k * ws;
        for (int64_t c = 0; c < C; c++) o[c] += xi[c] * wk[c];
      }
      for (int64_t c = 0; c < C && bp; c++) o[c] += bp[c];
    }
  });
  return y;
}

Tensor mamba_scan_rows(const Tensor &state, const Tensor &decay, const Tensor &u, const Tensor &B, const Tensor &C) {
  TORCH_CHECK_VALUE(u.dim() == 3 && B.dim() == 3 && C.dim() == 3 && decay.dim() == 2 && state.dim() == 3,
                    "mamba_scan_rows: state must be (H, P, N), decay (T, H), u (T, H, P), B and C (T, G, N)");
  int64_t T = u.size(0), H = u.size(1), P = u.size(2), G = B.size(1), N = B.size(2);
  TORCH_CHECK_VALUE(state.scalar_type() == at::kFloat && state.is_contiguous() &&
                        state.sizes() == at::IntArrayRef({H, P, N}) && decay.sizes() == at::IntArrayRef({T, H}) &&
                        B.size(0) == T && C.sizes() == B.sizes() && G > 0 && H % G == 0,
                    "mamba_scan_rows: state must be a contiguous fp32 (H, P, N), decay (T, H), u (T, H, P), B and C "
                    "(T, G, N) with G dividing H");
  Tensor d = decay.to(at::kFloat).contiguous(), uc = u.to(at::kFloat).contiguous();
  auto [Bc, Cm, row] = bc_rows(B, C);
  Tensor y = at::empty({T, H, P}, u.options().dtype(at::kFloat));
  float *s = state.data_ptr<float>(), *yp = y.data_ptr<float>();
  const float *dp = d.data_ptr<float>(), *up = uc.data_ptr<float>(), *Bp = Bc.data_ptr<float>(),
              *Cp = Cm.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {  // heads are independent: shared out over the threads
    for (int64_t h = h0; h < h1; h++)
      mamba_head(dp, up, Bp, Cp, row, s + h * P * N, nullptr, nullptr, nullptr, yp, 0, h, T, H, G, P, N);
  });
  return y;
}

void kv_write(const Tensor &k_cache, const Tensor &v_cache, const Tensor &slot_ids, const Tensor &pos,
              const Tensor &k, const Tensor &v) {
  int64_t nb = k.size(0), K = k.size(1), S = k_cache.size(0), L = k_cache.size(1);
  // a cache may be cut to the step's KV rows (S, kv, Hkv, Dh): its slots are apart, its rows must be contiguous
  bool rows_ok = k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                 k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
                 k_cache.stride(1) == k_cache.size(2) * k_cache.size(3);
  TORCH_CHECK_VALUE(rows_ok && k.dim() == 4 && k.sizes() == v.sizes() && k.size(2) == k_cache.size(2) &&
                        k.size(3) == k_cache.size(3) && pos.sizes() == k.sizes().slice(0, 2),
                    "kv_write: caches (S, L, Hkv, Dh), each position's rows contiguous, and rows k, v (B, K, Hkv, Dh) "
                    "at pos (B, K)");
  Tensor slots = slot_ids.to(at::kLong).contiguous(), at_pos = pos.to(at::kLong).contiguous();
  check_slots("kv_write", slots, S);
  const int64_t *p = at_pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < nb * K; i++)
    TORCH_CHECK_VALUE(0 <= p[i] && p[i] < L, "kv_write: position ", p[i], " (row ", i / K, ", ", i % K,
                      ") must lie in [0, ", L, ")");
  int64_t es = k_cache.element_size(), row = k_cache.stride(1) * es, slot = k_cache.stride(0) * es;
  for (auto [cache, rows] : {std::pair{k_cache, k}, std::pair{v_cache, v}}) {
    Tensor r = dense_rows(rows.to(cache.scalar_type()), 2);  // a position's Hkv Dh values together
    char *dst = static_cast<char *>(cache.data_ptr());
    const char *src = static_cast<const char *>(r.data_ptr());
    for (int64_t i = 0; i < nb * K; i++)
      std::memcpy(dst + slots.data_ptr<int64_t>()[i / K] * slot + p[i] * row,
                  src + ((i / K) * r.stride(0) + (i % K) * r.stride(1)) * es, row);
  }
}

// attend and attend_block: the block's own rows k_own, v_own, or none (nullptr)
Tensor attend_rows_of(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &slot_ids,
                      const Tensor &pos, double scale, const Tensor *k_own, const Tensor *v_own) {
  bool own = k_own != nullptr;
  TORCH_CHECK_VALUE(q.dim() == 4 && k_cache.dim() == 4 && (!own || (k_own->dim() == 4 && v_own->dim() == 4)),
                    "attend: q (B, K, Hq, Dh), caches (S, L, Hkv, Dh) and own rows (B, E, Hkv, Dh) are 4-d");
  int64_t nb = q.size(0), K = q.size(1), Hq = q.size(2), Dh = q.size(3), S = k_cache.size(0), L = k_cache.size(1);
  int64_t Hkv = k_cache.size(2), E = own ? k_own->size(1) : 0;
  at::ScalarType dtype = k_cache.scalar_type();
  bool cache_ok = k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.size(3) == Dh && Dh < 16 * (ATTEND_DV + 1) && k_cache.stride(3) == 1 &&
                  k_cache.stride(2) == Dh && k_cache.stride(1) == Hkv * Dh && v_cache.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
  bool own_ok = !own || (k_own->sizes() == v_own->sizes() && k_own->size(0) == nb && k_own->size(2) == Hkv &&
                         k_own->size(3) == Dh);
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat && cache_ok && own_ok && Hkv > 0 && Hq % Hkv == 0 &&
                        pos.sizes() == q.sizes().slice(0, 2) && slot_ids.numel() == nb,
                    "attend: q (B, K, Hq, Dh) fp32, caches (S, L, Hkv, Dh) of one float dtype with each position's "
                    "rows contiguous and Dh below ", 16 * (ATTEND_DV + 1), ", pos (B, K), own rows (B, E, Hkv, Dh)");
  Tensor slots = slot_ids.to(at::kLong).contiguous(), at_pos = pos.to(at::kLong).contiguous();
  Tensor qc = dense_rows(q, 1);  // q may be a view of a fused q/k/v product
  Tensor ko = own ? k_own->to(dtype).contiguous() : Tensor(), vo = own ? v_own->to(dtype).contiguous() : Tensor();
  check_slots("attend", slots, S);
  const int64_t *p = at_pos.data_ptr<int64_t>();
  int64_t span = E;  // the most rows a query sees: each thread's scores
  for (int64_t i = 0; i < nb * K; i++) {  // a row with rows of its own may see none of the cache
    TORCH_CHECK_VALUE((E > 0 ? -1 : 0) <= p[i] && p[i] < L, "attend: position ", p[i], " (row ", i / K, ", ", i % K,
                      ") must lie in [", E > 0 ? -1 : 0, ", ", L, ")");
    span = p[i] + 1 + E > span ? p[i] + 1 + E : span;
  }
  Tensor o = at::empty({nb, K, Hq, Dh}, q.options());
  auto run = [&](auto *type) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(type)>>;
    auto data = [](const Tensor &t) { return t.defined() ? static_cast<const T *>(t.data_ptr()) : nullptr; };
    attend_rows(qc.data_ptr<float>(), qc.strides().data(), data(k_cache), data(v_cache), data(ko), data(vo),
                slots.data_ptr<int64_t>(), p, o.data_ptr<float>(), nb, K, E, Hq, Hkv, Dh, k_cache.stride(0),
                k_cache.stride(1), float(scale), span);
  };
  switch (dtype) {
    case at::kFloat: run(static_cast<float *>(nullptr)); break;
    case at::kBFloat16: run(static_cast<uint16_t *>(nullptr)); break;
    default: run(static_cast<c10::Half *>(nullptr));  // kHalf
  }
  return o;
}

Tensor attend(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &slot_ids, const Tensor &pos,
              double scale) {
  return attend_rows_of(q, k_cache, v_cache, slot_ids, pos, scale, nullptr, nullptr);
}

Tensor attend_block(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &slot_ids,
                    const Tensor &pos, double scale, const Tensor &k_own, const Tensor &v_own) {
  return attend_rows_of(q, k_cache, v_cache, slot_ids, pos, scale, &k_own, &v_own);
}

void commit_state(const Tensor &ssm_state, const Tensor &conv_state, const Tensor &ssm_stash,
                  const Tensor &conv_stash, const Tensor &slot_ids, const Tensor &na, const Tensor &active) {
  int64_t L = ssm_state.size(0), S = ssm_state.size(1), nb = ssm_stash.size(1), K = ssm_stash.size(2);
  int64_t Cc = conv_state.size(2), Wm1 = conv_state.size(3);
  TORCH_CHECK_VALUE(ssm_state.is_contiguous() && ssm_stash.is_contiguous() && conv_state.is_contiguous() &&
                        conv_stash.is_contiguous() && ssm_state.scalar_type() == ssm_stash.scalar_type() &&
                        conv_state.scalar_type() == conv_stash.scalar_type() && ssm_stash.size(0) == L &&
                        ssm_stash.sizes().slice(3) == ssm_state.sizes().slice(2) &&
                        conv_stash.sizes() == at::IntArrayRef({L, nb, Cc, Wm1 + K}) && conv_state.size(0) == L &&
                        conv_state.size(1) == S && na.numel() == nb && active.numel() == nb,
                    "commit_state: contiguous ssm_state (L, S, H, P, N), ssm_stash (L, B, K, H, P, N), conv_state "
                    "(L, S, C, W-1) and conv_stash (L, B, C, W-1+K), stashes of their state's dtype; na, active (B,)");
  Tensor slots = slot_ids.to(at::kLong).contiguous(), n = na.to(at::kLong).contiguous();
  Tensor act = active.to(at::kBool).contiguous();
  check_slots("commit_state", slots, S);
  int64_t hpn = ssm_state.stride(1) * ssm_state.element_size(), es = conv_state.element_size();
  char *ssm = static_cast<char *>(ssm_state.data_ptr()), *conv = static_cast<char *>(conv_state.data_ptr());
  const char *ssm_src = static_cast<const char *>(ssm_stash.data_ptr());
  const char *conv_src = static_cast<const char *>(conv_stash.data_ptr());
  for (int64_t b = 0; b < nb; b++) {
    int64_t r = n.data_ptr<int64_t>()[b], s = slots.data_ptr<int64_t>()[b];
    if (!act.data_ptr<bool>()[b] || r >= K - 1) continue;  // inactive, or a full accept: the state is right
    r = r < 0 ? 0 : r;
    for (int64_t l = 0; l < L; l++) {
      std::memcpy(ssm + (l * S + s) * hpn, ssm_src + ((l * nb + b) * K + r) * hpn, hpn);
      copy_window(conv + (l * S + s) * Cc * Wm1 * es, conv_src + (l * nb + b) * Cc * (Wm1 + K) * es, Cc, Wm1,
                  Wm1 + K, r + 1, es);  // the window after row r: columns r+1 .. r+W-1
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nano_spec, m) {
  m.def("rows_block() -> int", rows_block);
  m.def("rows_mm(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("rows_weight(Tensor packed, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(nano_spec, CPU, m) {
  m.impl("rows_mm", rows_mm);
  m.impl("rows_weight", rows_weight);
  m.impl("rows_linear", rows_linear);
  m.impl("mamba_write", mamba_write);
  m.impl("mamba_scan_rows", mamba_scan_rows);
  m.impl("conv_rows", conv_rows);
  m.impl("kv_write", kv_write);
  m.impl("attend", attend);
  m.impl("attend_block", attend_block);
  m.impl("commit_state", commit_state);
}
