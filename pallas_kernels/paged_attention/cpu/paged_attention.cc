// GQA softmax attention over a paged KV cache stacked over layers, read in place, as one XLA:CPU
// custom call (``cpu_kernel.py``; the oracle is ../reference.py):
//
//   out[b, t, h] = sum_j p_j v_j / sum_j p_j,  p_j = exp(s_j - max s),  s_j = scale * q[b, t, h] . k_j
//
// over the keys j = 0 .. positions[b, t] of row b (key j sits in slot tables[b, j / bs] * bs + j % bs
// of layer ``layer``'s cache), k and v of the query head's KV head h / G.
//
// Why a kernel: XLA gathers each row's keys into a fresh [B, W, KVH, hd] array (transposed) chunk by
// chunk of 128 keys and runs small batched dots on it; at decode sizes that was a quarter of the
// 107 M model's step at batch 1 (BENCHMARKS.md). Here each key and value is read once from
// the cache, for all G query heads that share it.
//
// Work items: (row, KV head, chunk of TC query tokens), on every thread of XLA's intra-op pool; each
// writes its own outputs, so the result does not depend on which thread ran which item.
// Cache: float32, or bfloat16 (as BF16 or its uint16 bits, ``models.common.pack16``), widened on load.
// ``round_p``: the probabilities are rounded to bfloat16 before they weight the values (as the
// model's XLA form does when its values are bfloat16); the normaliser sums them unrounded.
// head_dim must be a multiple of 16, at most 128 (the Python side checks).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxmoe_cpu;

constexpr int64_t TC = 16;  // query tokens per work item: a prefill chunk is shared out over threads

struct Problem {
  const float* q;  // [B, T, H, hd]
  float* out;      // [B, T, H, hd]
  const void* k;   // this layer's [S, KVH, hd]
  const void* v;
  const int32_t* tables;     // [B, NB]
  const int32_t* positions;  // [B, T]
  int64_t B, T, H, KVH, hd, NB, bs, S;
  float scale;
  bool round_p;
};

inline float round_bf16(float x) {  // to the nearest bfloat16, ties to even (as XLA's convert)
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

inline float hsum(vf v) {  // the sum of a vector's lanes, by halves
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 lo, hi;
  std::memcpy(&lo, &v, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
  const v8 s8 = lo + hi;
  v4 a, b;
  std::memcpy(&a, &s8, 16);
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + 16, 16);
  const v4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// The outputs of one query token for the G heads of KV head kvh, from its n visible keys; HDV =
// head_dim / 16, so a head's query and accumulator stay in registers.
template <int HDV, typename W>
void attend(const Problem& p, int64_t b, int64_t t, int64_t kvh, std::vector<int64_t>& slots, std::vector<float>& s) {
  const int64_t G = p.H / p.KVH, hd = HDV * V;
  const int64_t pos = std::max<int32_t>(p.positions[b * p.T + t], 0);
  const int64_t n = std::min(pos, p.NB * p.bs - 1) + 1;
  const int64_t np = (n + V - 1) / V * V;  // scores padded to whole vectors
  const int32_t* table = p.tables + b * p.NB;
  slots.resize(n);
  s.resize(G * np);
  const int64_t row = p.KVH * hd;  // elements per slot
  for (int64_t j = 0; j < n; ++j)  // out-of-range blocks are clamped, as XLA's gather clamps
    slots[j] = std::clamp<int64_t>(static_cast<int64_t>(table[j / p.bs]) * p.bs + j % p.bs, 0, p.S - 1) * row;
  const W* keys = static_cast<const W*>(p.k) + kvh * hd;
  const W* values = static_cast<const W*>(p.v) + kvh * hd;
  const float* q = p.q + ((b * p.T + t) * p.H + kvh * G) * hd;
  float* out = p.out + ((b * p.T + t) * p.H + kvh * G) * hd;
  for (int64_t g = 0; g < G; ++g) {
    vf qg[HDV];
    for (int d = 0; d < HDV; ++d) qg[d] = load(q + g * hd + d * V);
    float* sg = s.data() + g * np;
    for (int64_t j = 0; j < n; ++j) {
      const W* key = keys + slots[j];
      vf acc = qg[0] * load(key);
      for (int d = 1; d < HDV; ++d) acc += qg[d] * load(key + d * V);
      sg[j] = hsum(acc) * p.scale;
    }
    const float m = *std::max_element(sg, sg + n);
    for (int64_t j = 0; j < np; j += V) store(sg + j, exp_clamped(load(sg + j) - m));
    std::fill(sg + n, sg + np, 0.0f);
    vf sum = vf{};
    for (int64_t j = 0; j < np; j += V) sum += load(sg + j);
    const float norm = hsum(sum);
    if (p.round_p)
      for (int64_t j = 0; j < n; ++j) sg[j] = round_bf16(sg[j]);
    vf acc[HDV];
    for (int d = 0; d < HDV; ++d) acc[d] = vf{};
    for (int64_t j = 0; j < n; ++j) {
      const W* value = values + slots[j];
      const vf w = vf{} + sg[j];
      for (int d = 0; d < HDV; ++d) acc[d] += w * load(value + d * V);
    }
    const vf inv = vf{} + 1.0f / norm;
    for (int d = 0; d < HDV; ++d) store(out + g * hd + d * V, acc[d] * inv);
  }
}

template <int HDV, typename W>
void run(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t chunks = (p.T + TC - 1) / TC;
  for_each_item(pool, p.B * p.KVH * chunks, [&](int64_t item) {
    thread_local std::vector<int64_t> slots;
    thread_local std::vector<float> s;
    const int64_t b = item / (p.KVH * chunks), kvh = item / chunks % p.KVH, c = item % chunks;
    for (int64_t t = c * TC; t < std::min(p.T, (c + 1) * TC); ++t) attend<HDV, W>(p, b, t, kvh, slots, s);
  });
}

template <typename W>
ffi::Error run_any(ffi::ThreadPool& pool, const Problem& p) {
  switch (p.hd / V) {
    case 1: run<1, W>(pool, p); break;
    case 2: run<2, W>(pool, p); break;
    case 3: run<3, W>(pool, p); break;
    case 4: run<4, W>(pool, p); break;
    case 5: run<5, W>(pool, p); break;
    case 6: run<6, W>(pool, p); break;
    case 7: run<7, W>(pool, p); break;
    case 8: run<8, W>(pool, p); break;
    default: return ffi::Error::InvalidArgument("paged_attention: head_dim must be 16-128, a multiple of 16");
  }
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> positions,
                          int64_t block_size, float scale, int64_t round_p, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions(), pd = positions.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || pd.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q [B, T, H, hd], caches [L, S, KVH, hd] expected");
  const int64_t B = qd[0], T = qd[1], H = qd[2], hd = qd[3], L = kd[0], S = kd[1], KVH = kd[2];
  if (kd[3] != hd || KVH < 1 || H % KVH || hd % V || td[0] != B || pd[0] != B || pd[1] != T || block_size < 1)
    return ffi::Error::InvalidArgument("paged_attention: shapes do not match (head_dim % 16, H % KVH must be 0)");
  if (v.dimensions().size() != 4 || v.element_type() != k.element_type())
    return ffi::Error::InvalidArgument("paged_attention: k and v caches must have one shape and dtype");
  for (int i = 0; i < 4; ++i)
    if (v.dimensions()[i] != kd[i]) return ffi::Error::InvalidArgument("paged_attention: k and v caches differ");
  const auto type = k.element_type();
  const bool bf16 = type == ffi::DataType::BF16 || type == ffi::DataType::U16;
  if (!bf16 && type != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("paged_attention: the cache must be float32 or bfloat16");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  const int64_t at = l * S * KVH * hd * (bf16 ? 2 : 4);
  Problem p{q.typed_data(), out->typed_data(), static_cast<const char*>(k.untyped_data()) + at,
            static_cast<const char*>(v.untyped_data()) + at, tables.typed_data(), positions.typed_data(),
            B, T, H, KVH, hd, td[1], block_size, S, scale, round_p != 0};
  return bf16 ? run_any<uint16_t>(pool, p) : run_any<float>(pool, p);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, T, H, hd]
                                  .Arg<ffi::AnyBuffer>()         // k cache [L, S, KVH, hd]
                                  .Arg<ffi::AnyBuffer>()         // v cache [L, S, KVH, hd]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block tables [B, NB]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [B, T]
                                  .Attr<int64_t>("block_size")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("round_p")      // 1: probabilities rounded to bfloat16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, T, H, hd]
);
