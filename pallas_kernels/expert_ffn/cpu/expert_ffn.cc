// The expert FFN as one XLA:CPU custom call (``cpu_kernel`` in ../api.py; built by ../cpu_kernel.py).
//
//   y[t] = sum_k weights[t, k] * down_e(silu(x[t] @ gate_e) * (x[t] @ up_e)),  e = ids[t, k]
//
// Why a kernel: XLA:CPU runs each small-M matmul of a decode step on one thread at a fraction of the
// memory bandwidth, and copies an expert's weights when they are sliced out of the stacked array
// (BENCHMARKS.md, issue 17). Here the stacked weights [L, E, ...] are read in place at ``layer``,
// each routed expert's weights once per call, by every thread of XLA's intra-op pool.
//
// Work split: items are (routed expert, chunk of FC intermediate columns). An item computes
// h = silu(x_rows @ gate[:, chunk]) * (x_rows @ up[:, chunk]) for the expert's rows, scales each row by
// its combine weight and adds h @ down[chunk, :] into its thread's fp32 partial output; the sum over
// chunks is the whole down projection, so no thread waits for another before the final sum.
//
// Weights: float32, or 16-bit bfloat16 (as BF16 or as its uint16 bits, ``models.common.pack16``),
// widened to float32 on load. x and the combine weights come in float32, y goes out in float32.
// D and F must be multiples of 16 (the Python side checks).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int V = 16;     // floats per vector
constexpr int MR = 8;     // rows per pass over an item's weights (a register tile)

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

// The next block of weight rows, one block ahead (the rows are a page apart: the hardware
// prefetcher does not cross to them by itself).
template <typename W>
inline void prefetch(const W* p, bool ahead) {
  if (ahead) __builtin_prefetch(p, 0, 0);
}

// silu(g) = g / (1 + exp(-g)) on a vector; exp by range reduction (2^n * e^r, |r| <= ln2 / 2) and a
// degree-6 polynomial (relative error ~1e-7 on float32).
inline vf silu(vf g) {
  const vf magic = vf{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vf a = -g;
  a = a < 88.0f ? a : 88.0f;  // exp(88) is near float32's largest; silu(g) -> 0 there anyway
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
  return g / (1.0f + p * scale);
}

// Both projections walk the weight rows in order, a few rows at a time, each row's columns of the
// item contiguous: the hardware prefetcher streams them (a register tile over a few columns would
// jump a whole row per step, a page per load for float32 F = 1024). Accumulators live in a small
// buffer (L1) and are loaded and stored once per KB weight rows.
constexpr int KB = 8;

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
        prefetch(g + (k0 + KB + kk) * ldw + j, k0 + KB < K);
        prefetch(u + (k0 + KB + kk) * ldw + j, k0 + KB < K);
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
        prefetch(d + (k0 + KB + kk) * ldw + j, k0 + KB < K);
        const vf w = load(d + (k0 + kk) * ldw + j);
        for (int r = 0; r < R; ++r) acc[r] += hs[r][kk] * w;
      }
      for (int r = 0; r < R; ++r) store(y[r] + j, acc[r]);
    }
  }
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
  std::vector<std::vector<int64_t>> assignments;  // per expert: t * K + k
};

template <typename W>
void run_item(const Problem& p, int64_t item, float* y, std::vector<float>& scratch) {
  const int64_t e = p.expert_of_item[item], c0 = p.chunk_of_item[item] * p.FC;
  const int64_t width = std::min(p.FC, p.F - c0);
  const W* g = static_cast<const W*>(p.gate) + e * p.D * p.F + c0;
  const W* u = static_cast<const W*>(p.up) + e * p.D * p.F + c0;
  const W* d = static_cast<const W*>(p.down) + e * p.F * p.D + c0 * p.D;
  const std::vector<int64_t>& rows = p.assignments[e];
  const int64_t m = static_cast<int64_t>(rows.size());
  scratch.resize(2 * MR * width);
  float* h = scratch.data();  // gate accumulators, then h
  float* up = h + MR * width;
  for (int64_t r0 = 0; r0 < m; r0 += MR) {
    const int R = static_cast<int>(std::min<int64_t>(MR, m - r0));
    const float* xr[MR];
    float* yr[MR];
    for (int r = 0; r < R; ++r) {
      const int64_t a = rows[r0 + r];
      xr[r] = p.x + (a / p.K) * p.D;
      yr[r] = y + (a / p.K) * p.D;
    }
#define JAXMOE_GATE_UP(n) gate_up_rows<n>(xr, g, u, p.F, p.D, width, h, up)
    JAXMOE_BY_ROWS(R, JAXMOE_GATE_UP)
#undef JAXMOE_GATE_UP
    for (int r = 0; r < R; ++r) {  // h = combine weight * silu(gate) * up
      const float w = p.combine[rows[r0 + r]];
      for (int64_t i = 0; i < width; i += V)
        store(h + r * width + i, w * silu(load(h + r * width + i)) * load(up + r * width + i));
    }
    // rows of one expert are distinct assignments but may share a token (an expert chosen twice):
    // their down products then add into the same output row, one row at a time.
    bool distinct = true;
    for (int r = 1; r < R && distinct; ++r)
      for (int q = 0; q < r; ++q) distinct &= yr[r] != yr[q];
    if (distinct) {
#define JAXMOE_DOWN(n) down_rows<n>(h, width, d, p.D, width, p.D, yr)
      JAXMOE_BY_ROWS(R, JAXMOE_DOWN)
#undef JAXMOE_DOWN
    } else {
      for (int r = 0; r < R; ++r) down_rows<1>(h + r * width, width, d, p.D, width, p.D, &yr[r]);
    }
  }
}

// The items shared by the caller and its helpers: each participant claims a partial-output slot
// before its first item, then items one at a time; the caller sums the slots once every item is done
// (a helper that starts later finds no item and touches nothing; the shared_ptr keeps the state).
struct Shared {
  Shared(Problem prob, int slots) : p(std::move(prob)), partial(static_cast<size_t>(slots) * p.T * p.D) {}
  Problem p;
  std::vector<float> partial;  // [slots, T, D]
  std::atomic<int64_t> next_item{0}, done_items{0};
  std::atomic<int> next_slot{0};
  bool bf16 = false;
};

void participate(Shared& s) {
  const int64_t items = static_cast<int64_t>(s.p.expert_of_item.size());
  std::vector<float> h;
  float* y = nullptr;
  for (int64_t item = s.next_item.fetch_add(1); item < items; item = s.next_item.fetch_add(1)) {
    if (y == nullptr) {
      y = s.partial.data() + static_cast<size_t>(s.next_slot.fetch_add(1)) * s.p.T * s.p.D;
      std::fill(y, y + s.p.T * s.p.D, 0.0f);
    }
    if (s.bf16)
      run_item<uint16_t>(s.p, item, y, h);
    else
      run_item<float>(s.p, item, y, h);
    s.done_items.fetch_add(1);
  }
}

ffi::Error ExpertFfn(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                     ffi::Buffer<ffi::F32> combine, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer down,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), gd = gate.dimensions();
  if (xd.size() != 2 || gd.size() != 4 || ids.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("expert_ffn: x [T, D], ids [T, K], gate [L, E, D, F] expected");
  Problem p;
  p.T = xd[0];
  p.D = xd[1];
  p.K = ids.dimensions()[1];
  const int64_t L = gd[0], E = gd[1], F = gd[3];
  p.F = F;
  if (gd[2] != p.D || p.D % V || F % V)
    return ffi::Error::InvalidArgument("expert_ffn: D and F must match and be multiples of 16");
  const auto type = gate.element_type();
  const bool bf16 = type == ffi::DataType::BF16 || type == ffi::DataType::U16;
  if (!bf16 && type != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("expert_ffn: weights must be float32 or bfloat16");
  if (up.element_type() != type || down.element_type() != type)
    return ffi::Error::InvalidArgument("expert_ffn: gate, up and down must have one dtype");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("expert_ffn: layer out of range");
  const size_t wsize = bf16 ? 2 : 4;
  const size_t per_layer = static_cast<size_t>(E) * p.D * F * wsize;
  p.gate = static_cast<const char*>(gate.untyped_data()) + l * per_layer;
  p.up = static_cast<const char*>(up.untyped_data()) + l * per_layer;
  p.down = static_cast<const char*>(down.untyped_data()) + l * per_layer;
  p.x = x.typed_data();
  p.ids = ids.typed_data();
  p.combine = combine.typed_data();

  const int64_t want = pool.num_threads();
  p.assignments.assign(E, {});
  for (int64_t a = 0; a < p.T * p.K; ++a) {
    const int32_t e = p.ids[a];
    if (e >= 0 && e < E) p.assignments[e].push_back(a);
  }
  // Items: each routed expert whole, or in column chunks (multiples of 16) when fewer experts are
  // routed than twice the threads, so that every thread has work.
  int64_t active = 0;
  for (int64_t e = 0; e < E; ++e) active += !p.assignments[e].empty();
  const int64_t threads_max = std::max<int64_t>(1, want);
  const int64_t per_expert = active ? std::max<int64_t>(1, (2 * threads_max + active - 1) / active) : 1;
  p.FC = ((F + per_expert - 1) / per_expert + V - 1) / V * V;
  const int64_t chunks = (F + p.FC - 1) / p.FC;
  for (int64_t e = 0; e < E; ++e)
    if (!p.assignments[e].empty())
      for (int64_t c = 0; c < chunks; ++c) {
        p.expert_of_item.push_back(e);
        p.chunk_of_item.push_back(c);
      }

  float* out = y->typed_data();
  const int64_t items = static_cast<int64_t>(p.expert_of_item.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, items)));
  auto shared = std::make_shared<Shared>(std::move(p), threads);
  shared->bf16 = bf16;
  for (int i = 1; i < threads; ++i) pool.Schedule([shared] { participate(*shared); });
  participate(*shared);
  while (shared->done_items.load() < items) std::this_thread::yield();
  const Problem& q = shared->p;
  const size_t n = static_cast<size_t>(q.T) * q.D;
  std::fill(out, out + n, 0.0f);
  const int slots = shared->next_slot.load();
  for (int s = 0; s < slots; ++s) {
    const float* part = shared->partial.data() + s * n;
    for (size_t i = 0; i < n; ++i) out[i] += part[i];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxmoeExpertFfn, ExpertFfn,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // combine weights [T, K]
                                  .Arg<ffi::AnyBuffer>()         // gate [L, E, D, F]
                                  .Arg<ffi::AnyBuffer>()         // up [L, E, D, F]
                                  .Arg<ffi::AnyBuffer>()         // down [L, E, F, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, D]
);
