// What the C++ XLA:CPU kernels share (built by ../cpu_build.py, which hashes this file into every
// library's name): 16-float vectors (GCC/Clang vector extensions; -march=native picks the
// instructions), float32 / bfloat16 loads, a vector exp, and running work items on XLA's intra-op pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxmoe_cpu {

namespace ffi = xla::ffi;

constexpr int V = 16;  // floats per vector

typedef float vf __attribute__((vector_size(V * 4)));
typedef uint16_t vh __attribute__((vector_size(V * 2)));
typedef uint32_t vu __attribute__((vector_size(V * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load(const uint16_t* p) {  // bfloat16 bits -> float32
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// exp(a) on a vector, a clamped to [-88, 88] (exp(88) is near float32's largest); range reduction
// (2^n * e^r, |r| <= ln2 / 2) and a degree-6 polynomial (relative error ~1e-7 on float32).
inline vf exp_clamped(vf a) {
  const vf magic = vf{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  a = a < 88.0f ? a : 88.0f;
  a = a > -88.0f ? a : -88.0f;
  vf t = a * 1.44269504088896341f + magic;
  const vf n = t - magic;
  vu bits;
  std::memcpy(&bits, &t, sizeof t);
  vu mbits;
  std::memcpy(&mbits, &magic, sizeof magic);
  const vu scale_bits = (bits - mbits + 127u) << 23;  // 2^n
  vf scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  const vf r = a - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
  vf p = vf{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * scale;
}

// Claims items one at a time until none is left, running fn on each.
template <typename Fn>
void claim_items(std::atomic<int64_t>& next, std::atomic<int64_t>& done, int64_t items, Fn& fn) {
  for (int64_t item = next.fetch_add(1); item < items; item = next.fetch_add(1)) {
    fn(item);
    done.fetch_add(1);
  }
}

// Runs fn(item) for every item in [0, items) on the calling thread and up to threads - 1 helpers of
// XLA's intra-op pool; returns when all are done. A helper that starts late finds no item left and
// never calls fn (the shared_ptr keeps the counters alive for it).
template <typename Fn>
void for_each_item(ffi::ThreadPool& pool, int64_t items, Fn fn) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto c = std::make_shared<Counters>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([c, items, f = &fn] { claim_items(c->next, c->done, items, *f); });
  claim_items(c->next, c->done, items, fn);
  while (c->done.load() < items) std::this_thread::yield();
}

}  // namespace jaxmoe_cpu
