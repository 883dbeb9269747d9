// The expert FFN as one XLA:CPU custom call (``cpu_kernel`` in ../api.py; built by ../cpu_kernel.py),
// and, with the same tile, a matmul by one layer's matrix of a weight stack (``layer_matmul``).
//
//   y[t] = sum_k weights[t, k] * down_e(silu(x[t] @ gate_e) * (x[t] @ up_e)),  e = ids[t, k]
//
// Why a kernel: XLA:CPU reaches 15-25 GB/s on the small-M matmuls of a decode step, and copies an
// expert's weights when they are sliced out of the stacked array (BENCHMARKS.md). Here the stacked weights [L, E, ...] are read in place at ``layer``,
// each routed expert's weights once per call, by every thread of XLA's intra-op pool.
//
// Work split: items are (routed expert, chunk of FC intermediate columns). An item computes
// h = silu(x_rows @ gate[:, chunk]) * (x_rows @ up[:, chunk]) for the expert's rows, scales each row by
// its combine weight and writes h @ down[chunk, :] to its own rows of fp32 output; the sum over chunks
// is the whole down projection, so no thread waits for another before the final sum. That sum runs in
// a fixed order (token, choice, chunk), so the result does not depend on which thread ran which item:
// the same inputs give the same bits. A row's own sums (over D in its gate / up tiles, one accumulator
// per row; over each chunk in the down tile) do not depend on the other rows; only the chunk width
// does, as it grows with fewer routed experts: with the ``invariant`` attribute it is fixed by the
// thread count and top-k alone, so a row's output is bit-identical whatever it is batched with.
//
// Weights: float32, or 16-bit bfloat16 (as BF16 or as its uint16 bits, ``models.common.pack16``),
// widened to float32 on load; stored plain ([L, E, D, F] / [L, E, F, D]) or as column panels
// (``panels.py``: [L, E, F / P, D, P] / [L, E, D / P, F, P], the ``panel`` attribute P), which this
// kernel reads as one contiguous stream per panel, faster at every batch size (bench/expert_ffn_cpu.py).
// bfloat16 panels may come in pairs (the ``pairs`` attribute: [L, E, F / P, D / 2, 2 P], rows k and
// k + 1 interleaved column by column): then the activations are rounded to bfloat16 pairs too and
// each pair of rows is one bf16 dot (AVX512-BF16's vdpbf16ps) into float32 accumulators. The hidden
// activation h into the down projection is not rounded to bfloat16: it goes in as two bfloat16 parts
// (h = hi + lo, 16 bits of mantissa), two dots per pair of weight rows read once.
// int8 weights (``jaxmoe.quantization``: symmetric, one float32 scale per output column) come plain or
// as panels (no pairs) with their scales ([L, E, 1, F] / [L, E, 1, D]; the ``JaxmoeExpertFfnInt8`` target): the tiles widen
// the int8 values to float32 in registers and each output column of a projection is multiplied by its
// scale once, after the sum over its rows (x @ (q * s) = (x @ q) * s), so no dequantized copy is made.
// x and the combine weights come in float32, y goes out in float32.
// D and F must be multiples of 16 (the Python side checks).

#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxmoe_cpu;

constexpr int MR = 8;  // rows per pass over an item's weights (a register tile)

// The next block of weight rows, one block ahead (float32 rows of F = 1024 are a page apart).
template <typename W>
inline void prefetch(const W* p, bool ahead) {
  if (ahead) __builtin_prefetch(p, 0, 0);
}

using jaxmoe_cpu::load;  // beside this overload (float32, bfloat16 from common.h)

inline vf load(const int8_t* p) {  // int8 -> float32
  typedef int8_t vb __attribute__((vector_size(V)));
  typedef int32_t vi __attribute__((vector_size(V * 4)));
  vb b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}

// silu(g) = g / (1 + exp(-g)) on a vector (``exp_clamped``: silu(g) -> 0 where -g > 88 anyway).
inline vf silu(vf g) { return g / (1.0f + exp_clamped(-g)); }

// Both projections walk the weight rows in order, a few rows at a time, each row's columns of the
// item contiguous (a register tile over 32 columns, jumping a whole row per step, reached 17 GB/s on
// one thread; this order 40). Accumulators live in a small buffer (L1) and are loaded and stored once
// per KB weight rows.
constexpr int KB = 8;
constexpr int PF = KB;  // rows ahead of the prefetch (one block; 2 or 4 blocks, or KB 2-16, measured no better)

// acc_g / acc_u [R, N] = x_r @ g[:, 0:N] / x_r @ u[:, 0:N] for R rows (row pointers x[r]); K % KB == 0.
template <int R, typename W>
void gate_up_rows(const float* const* x, const W* g, const W* u, int64_t ldw, int64_t K, int64_t N, float* acc_g,
                  float* acc_u) {
  std::fill(acc_g, acc_g + R * N, 0.0f);
  std::fill(acc_u, acc_u + R * N, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    float xs[R][KB];
    for (int r = 0; r < R; ++r)
      for (int kk = 0; kk < KB; ++kk) xs[r][kk] = x[r][k0 + kk];
    for (int64_t j = 0; j < N; j += V) {
      vf ag[R], au[R];
      for (int r = 0; r < R; ++r) {
        ag[r] = load(acc_g + r * N + j);
        au[r] = load(acc_u + r * N + j);
      }
      for (int kk = 0; kk < KB; ++kk) {
        prefetch(g + (k0 + PF + kk) * ldw + j, k0 + PF < K);
        prefetch(u + (k0 + PF + kk) * ldw + j, k0 + PF < K);
        const vf wg = load(g + (k0 + kk) * ldw + j), wu = load(u + (k0 + kk) * ldw + j);
        for (int r = 0; r < R; ++r) {
          ag[r] += xs[r][kk] * wg;
          au[r] += xs[r][kk] * wu;
        }
      }
      for (int r = 0; r < R; ++r) {
        store(acc_g + r * N + j, ag[r]);
        store(acc_u + r * N + j, au[r]);
      }
    }
  }
}

// y_r[0:N] += h[r, 0:K] @ d[0:K, 0:N] for R rows (output row pointers y[r]); K % KB == 0.
template <int R, typename W>
void down_rows(const float* h, int64_t ldh, const W* d, int64_t ldw, int64_t K, int64_t N, float* const* y) {
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    float hs[R][KB];
    for (int r = 0; r < R; ++r)
      for (int kk = 0; kk < KB; ++kk) hs[r][kk] = h[r * ldh + k0 + kk];
    for (int64_t j = 0; j < N; j += V) {
      vf acc[R];
      for (int r = 0; r < R; ++r) acc[r] = load(y[r] + j);
      for (int kk = 0; kk < KB; ++kk) {
        prefetch(d + (k0 + PF + kk) * ldw + j, k0 + PF < K);
        const vf w = load(d + (k0 + kk) * ldw + j);
        for (int r = 0; r < R; ++r) acc[r] += hs[r][kk] * w;
      }
      for (int r = 0; r < R; ++r) store(y[r] + j, acc[r]);
    }
  }
}

// ---- Column panels: a weight [K, N] stored as [N / P][K][P] (``panels.py``), P = 16 * S --------
// A register tile of R rows x P columns walks one panel's K rows, one contiguous stream: the
// accumulators stay in registers (up to 4 rows of 64 columns), and each weight vector loaded serves R
// rows. At 4 rows this read 49 GB/s on two threads against 37 for the row-streaming tile above
// (weights 400 MB, 2026-11-26); 5-8 rows (accumulators spilling to L1 at 64 columns) read 50-51 GB/s,
// so a pass takes up to MR rows. Many rows (prefill) pass over a panel again from L2.
constexpr int AHEAD = 8192;  // prefetch distance in bytes (2-8 KB measured within 10 %, 8 best; NTA best)

// out[r][0:P] = sum_k x[r][k] * w[k][0:P] for R rows (row pointers, already at their column / k start).
template <int R, int S, typename W>
void panel_tile(const float* const* x, const W* w, int64_t K, float* const* out) {
  constexpr int P = S * V;
  vf acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const W* row = w + k * P;
    for (int b = 0; b < P * static_cast<int>(sizeof(W)); b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(row) + AHEAD + b, 0, 0);
    vf wv[S];
    for (int s = 0; s < S; ++s) wv[s] = load(row + s * V);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r][k];
      for (int s = 0; s < S; ++s) acc[r][s] += xv * wv[s];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) store(out[r] + s * V, acc[r][s]);
}

// ---- Panels on AVX2 (no AVX-512): float32, bfloat16 and int8 weights, every row count ----------
// AVX2 has 16 vector registers of 8 floats. The generic tile above, on 64-byte vectors that AVX2
// holds in two registers, compiled (GCC 12) to accumulators kept on the stack, each x value stored 16
// times to build its broadcast, and, for int8, a scalar sign extension of every weight: one row of
// bfloat16 weights read at 6.6 GB/s where int8 (already on a tile of its own) read 24 (D 2048, F 5632,
// bench/int8_expert_kernel.py, 2026-11-28), and R x P accumulators (R x 8 registers at P = 64)
// spilled from 2 rows on (a prefill-sized item ran at about a tenth of XLA's matmul speed). Here the
// R rows x P columns are cut into sub-tiles of at most 4 rows x 8 accumulator registers, each a pass
// over the panel's K rows (the first pass streams the panel from memory with the prefetch, the later
// ones find it in cache); the weights are widened to float32 in registers, 8 at a time (bfloat16: a
// 16-bit shift of vpmovzxwd; int8: vpmovsxbd + vcvtdq2ps). Each output element is the same sum as the
// generic tile's (acc + x * w, k ascending, the same expression), so the results are the same.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define JAXMOE_PANEL_AVX2 1
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 bits -> float32
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline __m256 load8(const int8_t* p) {  // 8 int8 -> float32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// out[r][c0 + 0 : c0 + 8 HB] for RB rows over one panel of P columns (w at the panel's start).
template <int RB, int HB, int P, bool PREFETCH, typename W>
inline void panel_subtile_avx2(const float* const* x, const W* w, int64_t K, float* const* out, int c0) {
  __m256 acc[RB][HB];
  for (int r = 0; r < RB; ++r)
    for (int h = 0; h < HB; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const W* row = w + k * P;
    if constexpr (PREFETCH)
      for (int b = 0; b < P * static_cast<int>(sizeof(W)); b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row) + AHEAD + b, 0, 0);
    __m256 wv[HB];
    for (int h = 0; h < HB; ++h) wv[h] = load8(row + c0 + 8 * h);
    for (int r = 0; r < RB; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r][k]);
      for (int h = 0; h < HB; ++h) acc[r][h] = acc[r][h] + xv * wv[h];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int h = 0; h < HB; ++h) _mm256_storeu_ps(out[r] + c0 + 8 * h, acc[r][h]);
}

// Rows R0 .. R of the tile: groups of up to 4 rows, each over the columns in passes of 8 / rows registers.
template <int R, int S, int R0 = 0, typename W>
inline void panel_tile_avx2(const float* const* x, const W* w, int64_t K, float* const* out) {
  if constexpr (R0 < R) {
    constexpr int P = S * V, H = 2 * S, RB = R - R0 < 4 ? R - R0 : 4, HB = 8 / RB < H ? 8 / RB : H;
    panel_subtile_avx2<RB, HB, P, R0 == 0>(x + R0, w, K, out + R0, 0);
    for (int h0 = HB; h0 < H; h0 += HB) panel_subtile_avx2<RB, HB, P, false>(x + R0, w, K, out + R0, 8 * h0);
    panel_tile_avx2<R, S, R0 + RB>(x, w, K, out);
  }
}
#endif

// ---- Panels on AVX-512: float32, bfloat16 (widened) and int8 weights, every row count ----------
// The generic tile above, compiled (GCC 12, -march=x86-64-v4) for int8 weights, read one row at
// 1-2 GB/s against 26 for bfloat16 (a scalar sign extension per weight; D 2048, F 5632,
// bench/int8_expert_kernel.py, 2026-12-07). Here the weights are widened to float32 in registers,
// 16 at a time (int8: vpmovsxbd + vcvtdq2ps; bfloat16: vpmovzxwd + shift), and all R rows (up to MR)
// go in one pass over the panel, R x S accumulators (8 x 4 = 32 zmm at most, a few spilled to L1).
// Rows in groups of at most 6 (no spill, a second pass over the panel for 7-8 rows) were 0.6-0.9x as
// fast at 32 tokens (2026-12-07; likely because the stream's non-temporal prefetch does not leave the
// panel in cache for the second pass). Each output element is the same sum as the generic tile's (acc + x * w,
// k ascending), so the results are the same.
#if defined(__AVX512F__)
#define JAXMOE_PANEL_AVX512 1
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 bits -> float32
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
inline __m512 load16(const int8_t* p) {  // 16 int8 -> float32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// out[r][0:P] = sum_k x[r][k] * w[k][0:P] for R rows over one panel of P = 16 S columns.
template <int R, int S, typename W>
inline void panel_tile_avx512(const float* const* x, const W* w, int64_t K, float* const* out) {
  constexpr int P = S * V;
  __m512 acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const W* row = w + k * P;
    for (int b = 0; b < P * static_cast<int>(sizeof(W)); b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(row) + AHEAD + b, 0, 0);
    __m512 wv[S];
    for (int s = 0; s < S; ++s) wv[s] = load16(row + s * V);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r][k]);
      for (int s = 0; s < S; ++s) acc[r][s] = acc[r][s] + xv * wv[s];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(out[r] + s * V, acc[r][s]);
}
#endif

// ---- bfloat16 panels in pairs: [N / P][K / 2][2 P] -----------------------------------------------
// Lane j of a vector of pair row kp holds (w[2 kp][j], w[2 kp + 1][j]); x comes as the matching
// pairs (x[2 kp], x[2 kp + 1]) of bfloat16, packed in 32 bits. With AVX512-BF16 one vdpbf16ps adds
// both products to 16 float32 accumulators (1.1x the widening tile's speed at 1 row, 1.2x at 4 and
// 1.7x at 8 in a one-thread stream of 64 MB, 2026-11-26); without it the pairs are widened here.

inline uint32_t bf16_bits(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// dst[i] = (x[2 i], x[2 i + 1]) as bfloat16 bits, low half first, for i < K / 2.
inline void to_pairs(const float* x, int64_t K, uint32_t* dst) {
  for (int64_t i = 0; i < K / 2; ++i) dst[i] = bf16_bits(x[2 * i]) | (bf16_bits(x[2 * i + 1]) << 16);
}

inline float bf16_value(uint32_t bits) {  // the float32 of bfloat16 bits (low 16 bits)
  const uint32_t u = bits << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ``to_pairs`` of x into hi and of what rounding left (x - hi) into lo: hi + lo holds x to 16 bits of
// mantissa, where hi alone holds 8 (a hidden activation rounded to bfloat16 moved a logprob of the 107 M
// model by more than 0.1 nats).
inline void to_split_pairs(const float* x, int64_t K, uint32_t* hi, uint32_t* lo) {
  for (int64_t i = 0; i < K / 2; ++i) {
    const uint32_t h0 = bf16_bits(x[2 * i]), h1 = bf16_bits(x[2 * i + 1]);
    hi[i] = h0 | (h1 << 16);
    lo[i] = bf16_bits(x[2 * i] - bf16_value(h0)) | (bf16_bits(x[2 * i + 1] - bf16_value(h1)) << 16);
  }
}

// out[r][0:P] = sum_kp x[r][kp] . w[kp][0:P] for R rows of K2 pairs (pointers already at their start);
// ``SPLIT``: x[r][kp] + xlo[r][kp] instead of x[r][kp] (``to_split_pairs``).
template <int R, int S, bool SPLIT = false>
void pair_tile(const uint32_t* const* x, const uint16_t* w, int64_t K2, float* const* out,
               const uint32_t* const* xlo = nullptr) {
  constexpr int P = S * V;
#ifdef __AVX512BF16__
  __m512 acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    const uint16_t* row = w + kp * 2 * P;
    for (int b = 0; b < 2 * P * 2; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + AHEAD + b, 0, 0);
    __m512bh wv[S];
    for (int s = 0; s < S; ++s) wv[s] = (__m512bh)_mm512_loadu_si512(row + s * 2 * V);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r][kp]));
      for (int s = 0; s < S; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], xv, wv[s]);
      if constexpr (SPLIT) {
        const __m512bh xl = (__m512bh)_mm512_set1_epi32(static_cast<int>(xlo[r][kp]));
        for (int s = 0; s < S; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], xl, wv[s]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(out[r] + s * V, acc[r][s]);
#else
  vf acc[R][S];
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) acc[r][s] = vf{};
  for (int64_t kp = 0; kp < K2; ++kp) {
    const uint16_t* row = w + kp * 2 * P;
    vf lo[S], hi[S];  // rows 2 kp and 2 kp + 1
    for (int s = 0; s < S; ++s) {
      vu u;
      std::memcpy(&u, row + s * 2 * V, sizeof u);
      const vu l = u << 16, h = u & 0xffff0000u;
      std::memcpy(&lo[s], &l, sizeof l);
      std::memcpy(&hi[s], &h, sizeof h);
    }
    for (int r = 0; r < R; ++r) {
      const uint32_t xl = x[r][kp] << 16, xh = x[r][kp] & 0xffff0000u;
      float a, b;
      std::memcpy(&a, &xl, sizeof a);
      std::memcpy(&b, &xh, sizeof b);
      if constexpr (SPLIT) {  // hi + lo is exact in float32
        a += bf16_value(xlo[r][kp]);
        b += bf16_value(xlo[r][kp] >> 16);
      }
      for (int s = 0; s < S; ++s) acc[r][s] += a * lo[s] + b * hi[s];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int s = 0; s < S; ++s) store(out[r] + s * V, acc[r][s]);
#endif
}

// Dispatch a row count 1..MR to its template.
#define JAXMOE_BY_ROWS(rows, call)  \
  switch (rows) {                   \
    case 1: call(1); break;         \
    case 2: call(2); break;         \
    case 3: call(3); break;         \
    case 4: call(4); break;         \
    case 5: call(5); break;         \
    case 6: call(6); break;         \
    case 7: call(7); break;         \
    default: call(8); break;        \
  }

struct Problem {
  const float* x;       // [T, D]
  const float* combine;  // [T, K]
  const int32_t* ids;   // [T, K]
  int64_t T, K, D, F;
  int64_t FC;           // intermediate columns per work item
  const void* gate;     // expert e: gate + e * D * F (already at the layer)
  const void* up;
  const void* down;     // expert e: down + e * F * D
  std::vector<int64_t> expert_of_item, chunk_of_item;
  std::vector<int64_t> item_offset;               // where an item's output rows start in the buffer
  std::vector<int64_t> first_item;                // per expert: its first item (chunk 0), -1 if unrouted
  std::vector<int64_t> row_in_expert;             // per assignment t * K + k: its row in its expert
  std::vector<std::vector<int64_t>> assignments;  // per expert: t * K + k
  int64_t output_rows = 0;                        // sum over items of their expert's rows
  int64_t panel = 0;                              // 0: plain weights; else the panel width P
  bool pairs = false;                             // bfloat16 panels in pairs of rows
  const float* gate_scale = nullptr;              // int8 weights: expert e's column scales at e * F
  const float* up_scale = nullptr;
  const float* down_scale = nullptr;              // expert e: down_scale + e * D
};

// Item ``item`` into y, its own m x D rows (zeroed here), row i = the expert's i-th assignment.
template <typename W>
void run_item(const Problem& p, int64_t item, float* y, std::vector<float>& scratch) {
  const int64_t e = p.expert_of_item[item], c0 = p.chunk_of_item[item] * p.FC;
  const int64_t width = std::min(p.FC, p.F - c0);
  const W* g = static_cast<const W*>(p.gate) + e * p.D * p.F + c0;
  const W* u = static_cast<const W*>(p.up) + e * p.D * p.F + c0;
  const W* d = static_cast<const W*>(p.down) + e * p.F * p.D + c0 * p.D;
  const std::vector<int64_t>& rows = p.assignments[e];
  const int64_t m = static_cast<int64_t>(rows.size());
  std::fill(y, y + m * p.D, 0.0f);
  scratch.resize(2 * MR * width);
  float* h = scratch.data();  // gate accumulators, then h
  float* up = h + MR * width;
  for (int64_t r0 = 0; r0 < m; r0 += MR) {
    const int R = static_cast<int>(std::min<int64_t>(MR, m - r0));
    const float* xr[MR];
    float* yr[MR];
    for (int r = 0; r < R; ++r) {
      xr[r] = p.x + (rows[r0 + r] / p.K) * p.D;
      yr[r] = y + (r0 + r) * p.D;
    }
#define JAXMOE_GATE_UP(n) gate_up_rows<n>(xr, g, u, p.F, p.D, width, h, up)
    JAXMOE_BY_ROWS(R, JAXMOE_GATE_UP)
#undef JAXMOE_GATE_UP
    if (p.gate_scale) {  // int8: each column's scale, once per row after its sum
      const float* gs = p.gate_scale + e * p.F + c0;
      const float* us = p.up_scale + e * p.F + c0;
      for (int r = 0; r < R; ++r)
        for (int64_t i = 0; i < width; i += V) {
          store(h + r * width + i, load(h + r * width + i) * load(gs + i));
          store(up + r * width + i, load(up + r * width + i) * load(us + i));
        }
    }
    for (int r = 0; r < R; ++r) {  // h = combine weight * silu(gate) * up
      const float w = p.combine[rows[r0 + r]];
      for (int64_t i = 0; i < width; i += V)
        store(h + r * width + i, w * silu(load(h + r * width + i)) * load(up + r * width + i));
    }
#define JAXMOE_DOWN(n) down_rows<n>(h, width, d, p.D, width, p.D, yr)
    JAXMOE_BY_ROWS(R, JAXMOE_DOWN)
#undef JAXMOE_DOWN
  }
  if (p.down_scale) {  // int8: the item's rows (its part of the down projection) times each column's scale
    const float* ds = p.down_scale + e * p.D;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < p.D; i += V) store(y + r * p.D + i, load(y + r * p.D + i) * load(ds + i));
  }
}

// One tile over a panel's K rows: float32 rows for panels, bfloat16 pairs (K / 2 of them) for
// panels in pairs.
template <int R, int S, bool PAIRS, bool SPLIT = false, typename X, typename W>
inline void tile(const X* const* x, const W* w, int64_t K, float* const* out, const X* const* lo = nullptr) {
  if constexpr (PAIRS)
    pair_tile<R, S, SPLIT>(x, w, K / 2, out, lo);
#if defined(JAXMOE_PANEL_AVX512)
  else
    panel_tile_avx512<R, S>(x, w, K, out);
#elif defined(JAXMOE_PANEL_AVX2)
  else
    panel_tile_avx2<R, S>(x, w, K, out);
#else
  else
    panel_tile<R, S>(x, w, K, out);
#endif
}

// ``run_item`` for weights stored as panels of P = 16 * S columns: gate / up [F / P][D][P], down
// [D / P][F][P] per expert; an item's chunk of F is whole panels. ``PAIRS`` (bfloat16 panels in
// pairs, the same offsets): the expert's x rows are rounded to bfloat16 pairs once (in a bfloat16
// model they are bfloat16 already) and its h rows split into two (``to_split_pairs``), and every tile is
// a ``pair_tile``.
template <int S, typename W, bool PAIRS>
void run_item_panels(const Problem& p, int64_t item, float* y, std::vector<float>& scratch) {
  constexpr int P = S * V;
  using X = std::conditional_t<PAIRS, uint32_t, float>;  // what a tile multiplies the weights with
  const int64_t e = p.expert_of_item[item], c0 = p.chunk_of_item[item] * p.FC;
  const int64_t width = std::min(p.FC, p.F - c0);
  const W* g = static_cast<const W*>(p.gate) + e * p.D * p.F + c0 * p.D;  // the chunk's first panel
  const W* u = static_cast<const W*>(p.up) + e * p.D * p.F + c0 * p.D;
  const W* d = static_cast<const W*>(p.down) + e * p.F * p.D + c0 * P;   // row c0 of the first panel
  const std::vector<int64_t>& rows = p.assignments[e];
  const int64_t m = static_cast<int64_t>(rows.size());
  scratch.resize(m * width + MR * P);
  float* h = scratch.data();            // [m, width]: gate, then combine weight * silu(gate) * up
  float* up = h + m * width;            // [MR, P]: one panel's up projection
  thread_local std::vector<uint32_t> pairs;  // PAIRS: x rows [m, D / 2], then h rows [m, width / 2] hi, lo
  if constexpr (PAIRS) {
    pairs.resize(m * (p.D + 2 * width) / 2);
    for (int64_t r = 0; r < m; ++r) to_pairs(p.x + (rows[r] / p.K) * p.D, p.D, pairs.data() + r * p.D / 2);
  }
  auto x_row = [&](int64_t i) -> const X* {
    if constexpr (PAIRS)
      return pairs.data() + i * p.D / 2;
    else
      return p.x + (rows[i] / p.K) * p.D;
  };
  const X* xr[MR];
  float* out[MR];
  for (int64_t j = 0; j < width; j += P) {
    for (int64_t r0 = 0; r0 < m; r0 += MR) {
      const int R = static_cast<int>(std::min<int64_t>(MR, m - r0));
      for (int r = 0; r < R; ++r) {
        xr[r] = x_row(r0 + r);
        out[r] = h + (r0 + r) * width + j;
      }
#define JAXMOE_GATE(n) tile<n, S, PAIRS>(xr, g + j * p.D, p.D, out)
      JAXMOE_BY_ROWS(R, JAXMOE_GATE)
#undef JAXMOE_GATE
      for (int r = 0; r < R; ++r) out[r] = up + r * P;
#define JAXMOE_UP(n) tile<n, S, PAIRS>(xr, u + j * p.D, p.D, out)
      JAXMOE_BY_ROWS(R, JAXMOE_UP)
#undef JAXMOE_UP
      for (int r = 0; r < R; ++r) {
        float* hr = h + (r0 + r) * width + j;
        const float w = p.combine[rows[r0 + r]];
        if (p.gate_scale) {  // int8: each column's scale, once per row after its sum
          const float* gs = p.gate_scale + e * p.F + c0 + j;
          const float* us = p.up_scale + e * p.F + c0 + j;
          for (int i = 0; i < P; i += V)
            store(hr + i, w * silu(load(hr + i) * load(gs + i)) * (load(up + r * P + i) * load(us + i)));
        } else {
          for (int i = 0; i < P; i += V) store(hr + i, w * silu(load(hr + i)) * load(up + r * P + i));
        }
      }
    }
  }
  uint32_t *hp = nullptr, *hl = nullptr;
  if constexpr (PAIRS) {
    hp = pairs.data() + m * p.D / 2;
    hl = hp + m * width / 2;
    for (int64_t r = 0; r < m; ++r) to_split_pairs(h + r * width, width, hp + r * width / 2, hl + r * width / 2);
  }
  auto h_row = [&](int64_t i) -> const X* {
    if constexpr (PAIRS)
      return hp + i * width / 2;
    else
      return h + i * width;
  };
  const X* lr[MR];  // PAIRS: the lo parts of the h rows

  for (int64_t q = 0; q < p.D; q += P) {  // output panel q: rows c0 .. c0 + width of its F rows
    for (int64_t r0 = 0; r0 < m; r0 += MR) {
      const int R = static_cast<int>(std::min<int64_t>(MR, m - r0));
      for (int r = 0; r < R; ++r) {
        xr[r] = h_row(r0 + r);
        if constexpr (PAIRS) lr[r] = hl + (r0 + r) * width / 2;
        out[r] = y + (r0 + r) * p.D + q;
      }
#define JAXMOE_DOWN(n) tile<n, S, PAIRS, PAIRS>(xr, d + q * p.F, width, out, lr)
      JAXMOE_BY_ROWS(R, JAXMOE_DOWN)
#undef JAXMOE_DOWN
    }
  }
  if (p.down_scale) {  // int8: the item's part of the down projection times each column's scale
    const float* ds = p.down_scale + e * p.D;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < p.D; i += V) store(y + r * p.D + i, load(y + r * p.D + i) * load(ds + i));
  }
}

template <typename W, bool PAIRS>
void run_panels(const Problem& p, int64_t item, float* y, std::vector<float>& scratch) {
  switch (p.panel) {
    case V: run_item_panels<1, W, PAIRS>(p, item, y, scratch); break;
    case 2 * V: run_item_panels<2, W, PAIRS>(p, item, y, scratch); break;
    default: run_item_panels<4, W, PAIRS>(p, item, y, scratch); break;
  }
}

template <typename W>
void run_any(const Problem& p, int64_t item, float* y, std::vector<float>& scratch) {
  if (p.panel == 0)
    run_item<W>(p, item, y, scratch);
  else if constexpr (std::is_same_v<W, uint16_t>)
    p.pairs ? run_panels<W, true>(p, item, y, scratch) : run_panels<W, false>(p, item, y, scratch);
  else
    run_panels<W, false>(p, item, y, scratch);
}

struct Scales {  // int8 weights: the column scales [L, E, 1, F] / [L, E, 1, D]
  const float *gate, *up, *down;
  int64_t gate_size, down_size;  // elements
};

ffi::Error RunExpertFfn(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                        ffi::Buffer<ffi::F32> combine, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer down,
                        ffi::Buffer<ffi::S32> layer, int64_t panel, int64_t pairs, int64_t invariant,
                        const Scales* scales, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), gd = gate.dimensions(), dd = down.dimensions();
  if (panel != 0 && panel != V && panel != 2 * V && panel != 4 * V)
    return ffi::Error::InvalidArgument("expert_ffn: panel must be 0, 16, 32 or 64");
  const size_t rank = panel ? 5 : 4;
  if (xd.size() != 2 || gd.size() != rank || dd.size() != rank || ids.dimensions().size() != 2)
    return ffi::Error::InvalidArgument(
        "expert_ffn: x [T, D], ids [T, K], gate [L, E, D, F] (panels: [L, E, F / P, D, P]) expected");
  Problem p;
  p.T = xd[0];
  p.D = xd[1];
  p.K = ids.dimensions()[1];
  p.panel = panel;
  p.pairs = pairs != 0;
  if (p.pairs && !panel) return ffi::Error::InvalidArgument("expert_ffn: pairs needs panels");
  const int64_t L = gd[0], E = gd[1], F = panel ? gd[2] * panel : gd[3];
  p.F = F;
  const int64_t ph = p.pairs ? 2 : 1;  // panels in pairs: [K / 2, 2 P]
  const bool shapes = panel ? gd[3] * ph == p.D && gd[4] == panel * ph && dd[2] * panel == p.D &&
                                  dd[3] * ph == F && dd[4] == panel * ph
                            : gd[2] == p.D && dd[2] == F && dd[3] == p.D;
  if (!shapes || p.D % V || F % V || (panel && (p.D % panel || F % panel)))
    return ffi::Error::InvalidArgument("expert_ffn: D and F must match and be multiples of 16 (and of the panel)");
  const auto type = gate.element_type();
  const bool bf16 = type == ffi::DataType::BF16 || type == ffi::DataType::U16;
  const bool int8 = scales != nullptr;
  if (int8 && type != ffi::DataType::S8) return ffi::Error::InvalidArgument("expert_ffn_int8: weights must be int8");
  if (!int8 && !bf16 && type != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("expert_ffn: weights must be float32 or bfloat16");
  if (up.element_type() != type || down.element_type() != type)
    return ffi::Error::InvalidArgument("expert_ffn: gate, up and down must have one dtype");
  if (p.pairs && !bf16) return ffi::Error::InvalidArgument("expert_ffn: pairs are for bfloat16 weights");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("expert_ffn: layer out of range");
  const size_t wsize = int8 ? 1 : bf16 ? 2 : 4;
  const size_t per_layer = static_cast<size_t>(E) * p.D * F * wsize;
  if (int8) {
    if (scales->gate_size != L * E * F || scales->down_size != L * E * p.D)
      return ffi::Error::InvalidArgument("expert_ffn_int8: scales must be [L, E, 1, F] and [L, E, 1, D]");
    p.gate_scale = scales->gate + l * E * F;
    p.up_scale = scales->up + l * E * F;
    p.down_scale = scales->down + l * E * p.D;
  }
  p.gate = static_cast<const char*>(gate.untyped_data()) + l * per_layer;
  p.up = static_cast<const char*>(up.untyped_data()) + l * per_layer;
  p.down = static_cast<const char*>(down.untyped_data()) + l * per_layer;
  p.x = x.typed_data();
  p.ids = ids.typed_data();
  p.combine = combine.typed_data();

  p.assignments.assign(E, {});
  p.row_in_expert.assign(p.T * p.K, -1);
  for (int64_t a = 0; a < p.T * p.K; ++a) {
    const int32_t e = p.ids[a];
    if (e < 0 || e >= E) continue;
    p.row_in_expert[a] = static_cast<int64_t>(p.assignments[e].size());
    p.assignments[e].push_back(a);
  }
  // Items: each routed expert whole (its weights one contiguous stream), or in column chunks
  // (multiples of 16, or whole panels) when fewer experts are routed than there are threads, so that
  // every thread has work. (Chunking down to twice the threads was 20-30 % slower at batch 1: half
  // rows, two streams. Cutting experts into 256-column chunks at prefill sizes, to share out experts
  // with many rows, was 10 % slower on evenly routed batches: more partial rows to sum on one thread.)
  // ``invariant``: the chunks do not depend on the batch (on how many experts it routes to), only on
  // the thread count and top-k, so each row's down projection is summed in the same order whatever
  // it is batched with (deterministic mode, ``cpu_kernel.py``).
  int64_t active = 0;
  for (int64_t e = 0; e < E; ++e) active += !p.assignments[e].empty();
  if (invariant) active = std::min(E, p.K);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_expert = active ? std::max<int64_t>(1, (threads + active - 1) / active) : 1;
  const int64_t unit = panel ? panel : V;  // chunks are whole panels (or vectors)
  p.FC = ((F + per_expert - 1) / per_expert + unit - 1) / unit * unit;
  const int64_t chunks = (F + p.FC - 1) / p.FC;
  p.first_item.assign(E, -1);
  for (int64_t e = 0; e < E; ++e) {
    if (p.assignments[e].empty()) continue;
    p.first_item[e] = static_cast<int64_t>(p.expert_of_item.size());
    for (int64_t c = 0; c < chunks; ++c) {
      p.expert_of_item.push_back(e);
      p.chunk_of_item.push_back(c);
      p.item_offset.push_back(p.output_rows * p.D);
      p.output_rows += static_cast<int64_t>(p.assignments[e].size());
    }
  }

  // Every item into its own rows, then the sum in a fixed order (token, choice, chunk).
  std::vector<float> partial(static_cast<size_t>(p.output_rows) * p.D);
  for_each_item(pool, static_cast<int64_t>(p.expert_of_item.size()), [&](int64_t item) {
    thread_local std::vector<float> scratch;
    float* rows = partial.data() + p.item_offset[item];
    if (int8)
      run_any<int8_t>(p, item, rows, scratch);
    else if (bf16)
      run_any<uint16_t>(p, item, rows, scratch);
    else
      run_any<float>(p, item, rows, scratch);
  });
  float* out = y->typed_data();
  std::fill(out, out + p.T * p.D, 0.0f);
  for (int64_t a = 0; a < p.T * p.K; ++a) {
    if (p.row_in_expert[a] < 0) continue;
    float* row = out + (a / p.K) * p.D;
    const int64_t first = p.first_item[p.ids[a]];
    for (int64_t c = 0; c < chunks; ++c) {
      const float* part = partial.data() + p.item_offset[first + c] + p.row_in_expert[a] * p.D;
      for (int64_t i = 0; i < p.D; ++i) row[i] += part[i];
    }
  }
  return ffi::Error::Success();
}

ffi::Error ExpertFfn(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                     ffi::Buffer<ffi::F32> combine, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer down,
                     ffi::Buffer<ffi::S32> layer, int64_t panel, int64_t pairs, int64_t invariant,
                     ffi::ResultBuffer<ffi::F32> y) {
  return RunExpertFfn(pool, x, ids, combine, gate, up, down, layer, panel, pairs, invariant, nullptr, y);
}

ffi::Error ExpertFfnInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::F32> combine, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer down,
                         ffi::Buffer<ffi::F32> gate_scale, ffi::Buffer<ffi::F32> up_scale,
                         ffi::Buffer<ffi::F32> down_scale, ffi::Buffer<ffi::S32> layer, int64_t panel,
                         int64_t invariant, ffi::ResultBuffer<ffi::F32> y) {
  if (up_scale.element_count() != gate_scale.element_count())
    return ffi::Error::InvalidArgument("expert_ffn_int8: gate and up scales must match");
  const Scales scales{gate_scale.typed_data(), up_scale.typed_data(), down_scale.typed_data(),
                      static_cast<int64_t>(gate_scale.element_count()),
                      static_cast<int64_t>(down_scale.element_count())};
  return RunExpertFfn(pool, x, ids, combine, gate, up, down, layer, panel, 0, invariant, &scales, y);
}

// ---- One layer's weight matrix of a stack: y [M, N] = x [M, K] @ w[layer] ([L, K, N]) ----------
// The down projection's tile; items are contiguous blocks of K rows (one per thread), each into its
// own [M, N] partial, summed in item order (same inputs, same bits). The items depend on K and the
// thread count only, so a row's result does not depend on M or on the other rows (batch-invariant).
// More rows than a group: the rows pass over the matrix in blocks of NB columns x KB2 rows (256 KB, in L2)
// instead of each group of MR rows streaming the whole matrix from memory (16 rows of a 32000 x 2048
// bf16 LM head: two reads of 131 MB). Each output element is the same sum in the same order (k
// ascending), blocked or not.
// On AVX2 the rows go 4 at a time (8 accumulator registers; 8 rows spilled them).
constexpr int64_t NB = 1024;
#ifdef JAXMOE_PANEL_AVX2
constexpr int MATMUL_ROWS = 4;
#else
constexpr int MATMUL_ROWS = MR;
#endif

template <typename W>
void matmul_item(const float* x, const W* w, int64_t M, int64_t K, int64_t N, int64_t c0, int64_t kc, float* y) {
  std::fill(y, y + M * N, 0.0f);
  constexpr int G = MATMUL_ROWS;
  const int64_t nb = M > G ? NB : N, kb2 = M > G ? static_cast<int64_t>(256 * 1024 / (NB * sizeof(W))) : kc;
  for (int64_t n0 = 0; n0 < N; n0 += nb) {
    const int64_t nc = std::min(nb, N - n0);
    for (int64_t k0 = 0; k0 < kc; k0 += kb2) {
      const int64_t kr = std::min(kb2, kc - k0);
      for (int64_t r0 = 0; r0 < M; r0 += G) {
        const int R = static_cast<int>(std::min<int64_t>(G, M - r0));
        float* yr[MR];
        for (int r = 0; r < R; ++r) yr[r] = y + (r0 + r) * N + n0;
#define JAXMOE_MATMUL(n) down_rows<n>(x + r0 * K + c0 + k0, K, w + (c0 + k0) * N + n0, N, kr, nc, yr)
        JAXMOE_BY_ROWS(R, JAXMOE_MATMUL)
#undef JAXMOE_MATMUL
      }
    }
  }
}

ffi::Error LayerMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("layer_matmul: x [M, K] and w [L, K, N] expected");
  const int64_t L = wd[0], M = xd[0], K = wd[1], N = wd[2];
  if (K % KB || N % V) return ffi::Error::InvalidArgument("layer_matmul: K % 8 and N % 16 must be 0");
  const auto type = w.element_type();
  const bool bf16 = type == ffi::DataType::BF16 || type == ffi::DataType::U16;
  if (!bf16 && type != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("layer_matmul: w must be float32 or bfloat16");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("layer_matmul: layer out of range");
  const char* at = static_cast<const char*>(w.untyped_data()) + l * K * N * (bf16 ? 2 : 4);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t KC = ((K + threads - 1) / threads + KB - 1) / KB * KB;
  const int64_t items = (K + KC - 1) / KC;
  const size_t n = static_cast<size_t>(M) * N;
  std::vector<float> partial(items * n);
  for_each_item(pool, items, [&](int64_t item) {
    const int64_t c0 = item * KC, kc = std::min(KC, K - c0);
    if (bf16)
      matmul_item(x.typed_data(), reinterpret_cast<const uint16_t*>(at), M, K, N, c0, kc, partial.data() + item * n);
    else
      matmul_item(x.typed_data(), reinterpret_cast<const float*>(at), M, K, N, c0, kc, partial.data() + item * n);
  });
  float* out = y->typed_data();
  std::copy(partial.begin(), partial.begin() + n, out);
  for (int64_t item = 1; item < items; ++item)
    for (size_t i = 0; i < n; ++i) out[i] += partial[item * n + i];
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoeExpertFfn, ExpertFfn,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // combine weights [T, K]
                                  .Arg<ffi::AnyBuffer>()         // gate [L, E, D, F] or panels
                                  .Arg<ffi::AnyBuffer>()         // up [L, E, D, F] or panels
                                  .Arg<ffi::AnyBuffer>()         // down [L, E, F, D] or panels
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Attr<int64_t>("panel")        // 0: plain weights, else panel width
                                  .Attr<int64_t>("pairs")        // 1: bfloat16 panels in pairs of rows
                                  .Attr<int64_t>("invariant")    // 1: work split independent of the batch
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, D]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoeExpertFfnInt8, ExpertFfnInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // combine weights [T, K]
                                  .Arg<ffi::AnyBuffer>()         // gate [L, E, D, F] int8 or panels
                                  .Arg<ffi::AnyBuffer>()         // up [L, E, D, F] int8 or panels
                                  .Arg<ffi::AnyBuffer>()         // down [L, E, F, D] int8 or panels
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate scales [L, E, 1, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // up scales [L, E, 1, F]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // down scales [L, E, 1, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Attr<int64_t>("panel")        // 0: plain weights, else panel width
                                  .Attr<int64_t>("invariant")    // 1: work split independent of the batch
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, D]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoeLayerMatmul, LayerMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // w [L, K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);
