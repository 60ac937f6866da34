// CPU kernels: FedMix input/label mixing and its transpose, the per-sample l3 reduction and
// its backward, and the segmented (layer-wise) mixup of flat model states.
//
// Rules every kernel keeps:
// * one pass over the data each way, no temporaries the size of the inputs;
// * at::parallel_for over fixed-size pieces, and every reduction sums in an order fixed by
//   the shapes alone, so results do not depend on the number of threads (nor of ranks);
// * the arithmetic of the pure-PyTorch reference (fedhpc/ops/reference.py) in the same
//   order: products rounded before sums, no FMA contraction (built with -ffp-contract=off),
//   so elementwise outputs are bit-identical to it and reductions differ only by summation order;
// * inner loops over unit-stride runs with restrict pointers, which the compiler vectorises.
#include "../fedhpc_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace fedhpc {
namespace {

// Elements per parallel task: about 10 us of streaming, so a fork pays for itself and tiny
// tensors (a batch of labels) stay on the calling thread.
constexpr int64_t kGrain = 32768;
// Reduction block of l3: fixed, so the per-sample sums do not depend on how work is split.
constexpr int64_t kDotBlock = 4096;
// dot() keeps 128 / sizeof(T) independent partial sums (four 32-byte vectors; lane k sums the
// elements k, k + lanes, ...), written with vector types so that every ISA computes exactly these
// lanes: enough to hide the add latency, and the same sum on every CPU.
// Column tile of segment_mix when one large state is mixed into many: small enough to stay in
// L2 (256 KB in float32), long enough for the prefetchers (16K measured 0.75 of copy, 64K 0.85).
constexpr int64_t kSharedTile = 65536;

// The innermost loops, one per (operation, dtype). Each is compiled for AVX-512, AVX2 and the
// x86-64 baseline, picked when the library loads (target_clones): a wheel or JIT build made on
// one node runs everywhere, and in-cache sizes get the vector width torch's own kernels use.
// Without FMA contraction every clone rounds alike, so results do not depend on the CPU.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FEDHPC_SIMD __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FEDHPC_SIMD
#endif

// out = wa * a + wb * b, in the four aliasing cases, so that each loop gets restrict pointers
// (an in-place call, out == a, must not fall back to a scalar loop behind an alias check);
// scale: out = w * a; accumulate: acc += (c *) row; dot: independent lanes combined in double.
#define FEDHPC_LOOPS(T)                                                                                   \
  FEDHPC_SIMD void axpby_distinct(T* __restrict__ o, const T* __restrict__ a, const T* __restrict__ b,   \
                                  T wa, T wb, int64_t n) {                                              \
    for (int64_t i = 0; i < n; ++i) o[i] = wa * a[i] + wb * b[i];                                       \
  }                                                                                                     \
  FEDHPC_SIMD void axpby_into_a(T* __restrict__ a, const T* __restrict__ b, T wa, T wb, int64_t n) {    \
    for (int64_t i = 0; i < n; ++i) a[i] = wa * a[i] + wb * b[i];                                       \
  }                                                                                                     \
  FEDHPC_SIMD void axpby_into_b(const T* __restrict__ a, T* __restrict__ b, T wa, T wb, int64_t n) {    \
    for (int64_t i = 0; i < n; ++i) b[i] = wa * a[i] + wb * b[i];                                       \
  }                                                                                                     \
  FEDHPC_SIMD void scale(T* __restrict__ o, const T* __restrict__ a, T w, int64_t n) {                  \
    for (int64_t i = 0; i < n; ++i) o[i] = w * a[i];                                                    \
  }                                                                                                     \
  FEDHPC_SIMD void accumulate(T* __restrict__ acc, const T* __restrict__ row, int64_t n) {              \
    for (int64_t i = 0; i < n; ++i) acc[i] += row[i];                                                   \
  }                                                                                                     \
  FEDHPC_SIMD void accumulate(T* __restrict__ acc, const T* __restrict__ row, T c, int64_t n) {         \
    for (int64_t i = 0; i < n; ++i) acc[i] += c * row[i];                                               \
  }                                                                                                     \
  FEDHPC_SIMD double dot(const T* __restrict__ a, const T* __restrict__ b, int64_t n) {                 \
    typedef T vec __attribute__((vector_size(32)));                                                     \
    constexpr int w = 32 / sizeof(T);                                                                   \
    vec acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {}, va, vb;                                             \
    int64_t i = 0;                                                                                      \
    for (; i + 4 * w <= n; i += 4 * w) {                                                                \
      std::memcpy(&va, a + i, 32), std::memcpy(&vb, b + i, 32), acc0 += va * vb;                        \
      std::memcpy(&va, a + i + w, 32), std::memcpy(&vb, b + i + w, 32), acc1 += va * vb;                \
      std::memcpy(&va, a + i + 2 * w, 32), std::memcpy(&vb, b + i + 2 * w, 32), acc2 += va * vb;        \
      std::memcpy(&va, a + i + 3 * w, 32), std::memcpy(&vb, b + i + 3 * w, 32), acc3 += va * vb;        \
    }                                                                                                   \
    T lane[4 * w];                                                                                      \
    std::memcpy(lane, &acc0, 32), std::memcpy(lane + w, &acc1, 32);                                     \
    std::memcpy(lane + 2 * w, &acc2, 32), std::memcpy(lane + 3 * w, &acc3, 32);                         \
    for (int k = 0; i < n; ++i, ++k) lane[k] += a[i] * b[i];                                            \
    double s = 0;                                                                                       \
    for (int k = 0; k < 4 * w; ++k) s += static_cast<double>(lane[k]);                                  \
    return s;                                                                                           \
  }
FEDHPC_LOOPS(float)
FEDHPC_LOOPS(double)
#undef FEDHPC_LOOPS

// Out-of-place mixes larger than the caches: the same arithmetic (two rounded products, one
// rounded sum) with non-temporal stores, as memcpy does past its threshold. The output then
// bypasses the cache instead of being read in first (write-allocate), a third less memory
// traffic; a state that large is not read back soon.
//
// Every cache line of the output must be written whole by non-temporal stores: a line that
// mixes them with ordinary stores, or is left partly written, costs a read-modify-write in
// memory. Layer boundaries fall anywhere, so the stream does not stop at them: runs of whole
// vectors inside one segment take that segment's coefficient, and a vector straddling a
// boundary is assembled lane by lane (each lane with its own segment's coefficient, the same
// arithmetic) and stored whole. Per-segment streams measured 0.73-0.80 of copy bandwidth on one
// thread (8 clients x 4M, 1000 segments); the continuous stream is about a quarter faster.
// 32-byte stores where AVX is present (picked once at load), SSE2's 16-byte ones otherwise.
constexpr int64_t kStreamBytes = int64_t{16} << 20;
#if defined(__x86_64__) && defined(__GNUC__)
#define FEDHPC_STREAM 1
#define FEDHPC_AVX __attribute__((target("avx")))

// o[0, n) = wa * a + wb * b, o aligned to the vector, n a multiple of its lanes.
FEDHPC_AVX void stream_run_avx(float* o, const float* a, const float* b, float wa, float wb, int64_t n) {
  const __m256 va = _mm256_set1_ps(wa), vb = _mm256_set1_ps(wb);
  for (int64_t i = 0; i < n; i += 8) {
    _mm256_stream_ps(o + i, _mm256_add_ps(_mm256_mul_ps(va, _mm256_loadu_ps(a + i)), _mm256_mul_ps(vb, _mm256_loadu_ps(b + i))));
  }
}
FEDHPC_AVX void stream_run_avx(double* o, const double* a, const double* b, double wa, double wb, int64_t n) {
  const __m256d va = _mm256_set1_pd(wa), vb = _mm256_set1_pd(wb);
  for (int64_t i = 0; i < n; i += 4) {
    _mm256_stream_pd(o + i, _mm256_add_pd(_mm256_mul_pd(va, _mm256_loadu_pd(a + i)), _mm256_mul_pd(vb, _mm256_loadu_pd(b + i))));
  }
}
void stream_run_sse(float* o, const float* a, const float* b, float wa, float wb, int64_t n) {
  const __m128 va = _mm_set1_ps(wa), vb = _mm_set1_ps(wb);
  for (int64_t i = 0; i < n; i += 4) {
    _mm_stream_ps(o + i, _mm_add_ps(_mm_mul_ps(va, _mm_loadu_ps(a + i)), _mm_mul_ps(vb, _mm_loadu_ps(b + i))));
  }
}
void stream_run_sse(double* o, const double* a, const double* b, double wa, double wb, int64_t n) {
  const __m128d va = _mm_set1_pd(wa), vb = _mm_set1_pd(wb);
  for (int64_t i = 0; i < n; i += 2) {
    _mm_stream_pd(o + i, _mm_add_pd(_mm_mul_pd(va, _mm_loadu_pd(a + i)), _mm_mul_pd(vb, _mm_loadu_pd(b + i))));
  }
}
// One assembled vector t (aligned) stored to o.
FEDHPC_AVX void stream_one_avx(float* o, const float* t) { _mm256_stream_ps(o, _mm256_load_ps(t)); }
FEDHPC_AVX void stream_one_avx(double* o, const double* t) { _mm256_stream_pd(o, _mm256_load_pd(t)); }
void stream_one_sse(float* o, const float* t) { _mm_stream_ps(o, _mm_load_ps(t)); }
void stream_one_sse(double* o, const double* t) { _mm_stream_pd(o, _mm_load_pd(t)); }

template <typename T>
struct Streamer {
  int64_t lanes;
  void (*run)(T*, const T*, const T*, T, T, int64_t);
  void (*one)(T*, const T*);
};

template <typename T>
Streamer<T> streamer() {
  static const bool avx = __builtin_cpu_supports("avx") && cpu_simd_allowed();
  if (avx) return {int64_t{32} / int64_t{sizeof(T)}, &stream_run_avx, &stream_one_avx};
  return {int64_t{16} / int64_t{sizeof(T)}, &stream_run_sse, &stream_one_sse};
}

// Row [p, stop) of out = l_seg * a + (1 - l_seg) * b, s the segment holding p, in one stream.
template <typename T>
void segment_stream(const Streamer<T>& v, T* o, const T* a, const T* b, const T* lam, const int64_t* off, int64_t s,
                    int64_t p, int64_t stop) {
  const int64_t w = v.lanes;
  auto mixed = [&](int64_t& seg, int64_t i) {
    while (off[seg + 1] <= i) ++seg;
    const T l = lam[seg];
    return l * a[i] + (T(1) - l) * b[i];
  };
  int64_t i = p;
  // Ordinary stores up to the first aligned vector and after the last: only at the ends of a
  // task's range (tile or row), never at segment boundaries.
  for (; i < stop && reinterpret_cast<uintptr_t>(o + i) % (w * sizeof(T)) != 0; ++i) o[i] = mixed(s, i);
  while (i + w <= stop) {
    while (off[s + 1] <= i) ++s;
    const int64_t seg_end = std::min(off[s + 1], stop);
    if (seg_end >= i + w) {
      const int64_t n = (seg_end - i) / w * w;
      v.run(o + i, a + i, b + i, lam[s], T(1) - lam[s], n);
      i += n;
    } else {
      alignas(32) T t[32 / sizeof(T)];
      int64_t seg = s;
      for (int64_t k = 0; k < w; ++k) t[k] = mixed(seg, i + k);
      v.one(o + i, t);
      i += w;
    }
  }
  for (; i < stop; ++i) o[i] = mixed(s, i);
}
#endif

template <typename T>
inline void axpby(T* o, const T* a, const T* b, T wa, T wb, int64_t n) {
  if (o != a && o != b) {
    axpby_distinct(o, a, b, wa, wb, n);
  } else if (o == a && o != b) {
    axpby_into_a(o, b, wa, wb, n);
  } else if (o == b && o != a) {
    axpby_into_b(a, o, wa, wb, n);
  } else {  // all three the same memory: still elementwise, no restrict
    for (int64_t i = 0; i < n; ++i) o[i] = wa * a[i] + wb * b[i];
  }
}

// Calls fn(row, col_begin, col_end) for the row pieces of the flat range [begin, end).
template <typename F>
void for_rows(int64_t cols, int64_t begin, int64_t end, const F& fn) {
  int64_t r = begin / cols, c = begin % cols;
  while (begin < end) {
    const int64_t stop = std::min(cols, c + (end - begin));
    fn(r, c, stop);
    begin += stop - c;
    ++r;
    c = 0;
  }
}

// Runs fn(row, col_begin, col_end) over a (rows, cols) index space cut into kGrain pieces.
template <typename F>
void parallel_rows(int64_t rows, int64_t cols, const F& fn) {
  if (rows == 0 || cols == 0) return;
  at::parallel_for(0, rows * cols, kGrain, [&](int64_t begin, int64_t end) { for_rows(cols, begin, end, fn); });
}

// Non-temporal stores are weakly ordered: each task drains its own before the join publishes them.
inline void fence(bool streamed) {
#ifdef FEDHPC_STREAM
  if (streamed) _mm_sfence();
#endif
}

// Runs fn(col_begin, col_end) over column blocks of about kGrain / rows columns (column sums).
template <typename F>
void parallel_cols(int64_t rows, int64_t cols, const F& fn) {
  if (cols == 0) return;
  const int64_t grain = std::max<int64_t>(64, kGrain / std::max<int64_t>(rows, 1));
  at::parallel_for(0, cols, grain, fn);
}

// out (rows, cols) = wa * a + wb * b[row or 0]; b undefined: out = wa * a.
template <typename T>
void mix_pair(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, T wa, T wb) {
  const int64_t rows = a.size(0), cols = cols_of(a);
  T* o = out.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  if (!b.defined()) {
    parallel_rows(rows, cols, [&](int64_t r, int64_t c0, int64_t c1) {
      scale(o + r * cols + c0, ap + r * cols + c0, wa, c1 - c0);
    });
    return;
  }
  const T* bp = b.data_ptr<T>();
  const int64_t b_rs = b.size(0) == 1 ? 0 : cols;
  parallel_rows(rows, cols, [&](int64_t r, int64_t c0, int64_t c1) {
    axpby(o + r * cols + c0, ap + r * cols + c0, bp + r * b_rs + c0, wa, wb, c1 - c0);
  });
}

// Transpose of mix_pair: ga = wa * g; gb = wb * g (b had all rows) or wb * sum_rows g (b had one row).
// The reference differentiates (1-l) a + l b with b broadcast, where autograd sums the rows first
// and scales after: the same order is kept here.
template <typename T>
void mix_pair_transpose(const at::Tensor& g, const at::Tensor& ga, const at::Tensor& gb, T wa, T wb) {
  if (!g.defined()) return;  // a zero incoming gradient: nothing asked of this pair
  const int64_t rows = g.size(0), cols = cols_of(g);
  const T* gp = g.data_ptr<T>();
  T* gap = ga.defined() ? ga.data_ptr<T>() : nullptr;
  T* gbp = gb.defined() ? gb.data_ptr<T>() : nullptr;
  if (gbp != nullptr && gb.size(0) == 1) {  // one pass: column blocks, rows in order inside each
    if (rows == 0) {  // an empty batch: the sum over no rows
      std::fill(gbp, gbp + cols, T(0));
      return;
    }
    parallel_cols(rows, cols, [&](int64_t c0, int64_t c1) {
      const int64_t n = c1 - c0;
      std::vector<T> acc(gp + c0, gp + c1);  // row 0
      if (gap != nullptr) scale(gap + c0, gp + c0, wa, n);
      for (int64_t r = 1; r < rows; ++r) {
        const T* row = gp + r * cols + c0;
        accumulate(acc.data(), row, n);
        if (gap != nullptr) scale(gap + r * cols + c0, row, wa, n);
      }
      scale(gbp + c0, acc.data(), wb, n);
    });
    return;
  }
  parallel_rows(rows, cols, [&](int64_t r, int64_t c0, int64_t c1) {
    const int64_t at = r * cols + c0;
    if (gap != nullptr) scale(gap + at, gp + at, wa, c1 - c0);
    if (gbp != nullptr) scale(gbp + at, gp + at, wb, c1 - c0);
  });
}

}  // namespace

std::tuple<Tensor, Tensor> mix_forward_cpu(const Tensor& x, const Tensor& xbar, const Tensor& y,
                                           const Tensor& ybar, double lam) {
  Tensor xm = at::empty_like(x), ym = at::empty_like(y);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "fedhpc_mix_forward_cpu", [&] {
    const scalar_t wa = static_cast<scalar_t>(1.0 - lam), wb = static_cast<scalar_t>(lam);
    mix_pair<scalar_t>(xm, x, xbar, wa, wb);
    mix_pair<scalar_t>(ym, y, ybar, wa, wb);
  });
  return {xm, ym};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> mix_backward_cpu(const Tensor& gxm, const Tensor& gym,
                                                            int64_t xbar_rows, int64_t ybar_rows, double lam,
                                                            std::array<bool, 4> need) {
  auto grads = [](const Tensor& g, int64_t b_rows, bool need_a, bool need_b) {
    if (!g.defined()) return std::make_pair(Tensor(), Tensor());
    Tensor ga = need_a ? at::empty_like(g) : Tensor();
    Tensor gb = (need_b && b_rows > 0) ? at::empty({b_rows, cols_of(g)}, g.options()) : Tensor();
    return std::make_pair(ga, gb);
  };
  auto [gx, gxbar] = grads(gxm, xbar_rows, need[0], need[1]);
  auto [gy, gybar] = grads(gym, ybar_rows, need[2], need[3]);
  AT_DISPATCH_FLOATING_TYPES((gxm.defined() ? gxm : gym).scalar_type(), "fedhpc_mix_backward_cpu", [&] {
    const scalar_t wa = static_cast<scalar_t>(1.0 - lam), wb = static_cast<scalar_t>(lam);
    mix_pair_transpose<scalar_t>(gxm, gx, gxbar, wa, wb);
    mix_pair_transpose<scalar_t>(gym, gy, gybar, wa, wb);
  });
  return {gx, gxbar, gy, gybar};
}

Tensor l3_forward_cpu(const Tensor& g, const Tensor& xbar, double lam) {
  const int64_t rows = g.size(0), cols = cols_of(g);
  Tensor s = at::empty({rows}, g.options());
  const int64_t nblk = std::max<int64_t>(1, (cols + kDotBlock - 1) / kDotBlock);
  std::vector<double> part(rows * nblk, 0.0);
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "fedhpc_l3_forward_cpu", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* xp = xbar.data_ptr<scalar_t>();
    const int64_t x_rs = xbar.size(0) == 1 ? 0 : cols;
    at::parallel_for(0, rows * nblk, std::max<int64_t>(1, kGrain / kDotBlock), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t r = t / nblk, c0 = (t % nblk) * kDotBlock, n = std::min(kDotBlock, cols - c0);
        part[t] = n > 0 ? dot(gp + r * cols + c0, xp + r * x_rs + c0, n) : 0.0;
      }
    });
    scalar_t* sp = s.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) {  // blocks in order: the sum does not depend on the split
      double acc = 0;
      for (int64_t k = 0; k < nblk; ++k) acc += part[r * nblk + k];
      sp[r] = static_cast<scalar_t>(lam) * static_cast<scalar_t>(acc);
    }
  });
  return s;
}

std::tuple<Tensor, Tensor> l3_backward_cpu(const Tensor& go, const Tensor& g, const Tensor& xbar, double lam,
                                           bool need_g, bool need_xbar) {
  const int64_t rows = g.size(0), cols = cols_of(g), x_rows = xbar.size(0);
  Tensor gg = need_g ? at::empty_like(g) : Tensor();
  Tensor gx = need_xbar ? at::empty_like(xbar) : Tensor();
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "fedhpc_l3_backward_cpu", [&] {
    // c_i = lam * go_i, as autograd scales the incoming gradient before it fans out.
    std::vector<scalar_t> coef(rows);
    const scalar_t* gop = go.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) coef[r] = gop[r] * static_cast<scalar_t>(lam);
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* xp = xbar.data_ptr<scalar_t>();
    scalar_t* ggp = need_g ? gg.data_ptr<scalar_t>() : nullptr;
    scalar_t* gxp = need_xbar ? gx.data_ptr<scalar_t>() : nullptr;
    const int64_t x_rs = x_rows == 1 ? 0 : cols;
    if (need_xbar && x_rows == 1) {  // one pass: column blocks, grad_g written as the column sums run
      if (rows == 0) {
        std::fill(gxp, gxp + cols, scalar_t(0));
        return;
      }
      parallel_cols(rows, cols, [&](int64_t c0, int64_t c1) {
        const int64_t n = c1 - c0;
        std::vector<scalar_t> acc(n);
        scale(acc.data(), gp + c0, coef[0], n);
        if (ggp != nullptr) scale(ggp + c0, xp + c0, coef[0], n);
        for (int64_t r = 1; r < rows; ++r) {
          const scalar_t c = coef[r];
          accumulate(acc.data(), gp + r * cols + c0, c, n);
          if (ggp != nullptr) scale(ggp + r * cols + c0, xp + c0, c, n);
        }
        std::copy(acc.begin(), acc.end(), gxp + c0);
      });
      return;
    }
    parallel_rows(rows, cols, [&](int64_t r, int64_t c0, int64_t c1) {
      if (ggp != nullptr) scale(ggp + r * cols + c0, xp + r * x_rs + c0, coef[r], c1 - c0);
      if (gxp != nullptr) scale(gxp + r * cols + c0, gp + r * cols + c0, coef[r], c1 - c0);
    });
  });
  return {gg, gx};
}

void segment_mix_cpu(const Tensor& a, const Tensor& b, const Tensor& offsets, const Tensor& lam, Tensor& out) {
  const int64_t rows = out.size(0), cols = out.size(1), nseg = offsets.numel() - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "fedhpc_segment_mix_cpu", [&] {
    const scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* bp = b.data_ptr<scalar_t>();
    const scalar_t* lp = lam.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t a_rs = a.stride(0), b_rs = b.stride(0), o_rs = out.stride(0);
    const int64_t l_rs = lam.size(0) == 1 ? 0 : nseg;
#ifdef FEDHPC_STREAM
    const bool stream = rows * cols * static_cast<int64_t>(sizeof(scalar_t)) >= kStreamBytes &&
                        !(a_rs == o_rs && ap == op) && !(b_rs == o_rs && bp == op);
#else
    const bool stream = false;
#endif
#ifdef FEDHPC_STREAM
    const Streamer<scalar_t> streamed = streamer<scalar_t>();
#endif
    // Mixes row r over [p, stop): a walk over the segments that range crosses.
    auto run = [&](int64_t r, int64_t p, int64_t stop) {
      // The segment holding p: the last s with off[s] <= p (empty segments are skipped by construction).
      int64_t s = std::upper_bound(off, off + nseg + 1, p) - off - 1;
#ifdef FEDHPC_STREAM
      if (stream) {
        segment_stream(streamed, op + r * o_rs, ap + r * a_rs, bp + r * b_rs, lp + r * l_rs, off, s, p, stop);
        return;
      }
#endif
      while (p < stop) {
        while (off[s + 1] <= p) ++s;
        const int64_t e = std::min(off[s + 1], stop);
        const scalar_t l = lp[r * l_rs + s];
        const scalar_t om = scalar_t(1) - l;  // rounded as the reference's (1 - lam)
        axpby(op + r * o_rs + p, ap + r * a_rs + p, bp + r * b_rs + p, l, om, e - p);
        p = e;
      }
    };
    // Tiles only pay when the shared state does not stay in the last-level cache anyway: below
    // 8 MB the flat split over rows x columns keeps one sequential stream per thread, which
    // measured 0.83 -> 1.07 of copy bandwidth on 1 thread, 0.64 -> 0.88 on 2 (16 clients x 1M).
    const bool shared_in_cache = cols * static_cast<int64_t>(sizeof(scalar_t)) <= (int64_t{8} << 20);
    if (rows > 1 && (a_rs == 0 || b_rs == 0) && !shared_in_cache) {
      // One state against many (pMixFed: C clients vs the global model): column tiles outside,
      // clients inside, so the shared state's tile is read from memory once and from cache C-1 times.
      const int64_t tiles = (cols + kSharedTile - 1) / kSharedTile;
      at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t p = t * kSharedTile, stop = std::min(cols, p + kSharedTile);
          for (int64_t r = 0; r < rows; ++r) run(r, p, stop);
        }
        fence(stream);
      });
      return;
    }
    at::parallel_for(0, rows * cols, kGrain, [&](int64_t begin, int64_t end) {
      for_rows(cols, begin, end, run);
      fence(stream);
    });
  });
}

const char* segment_mix_stream_cpu_isa() {
#ifdef FEDHPC_STREAM
  return streamer<float>().lanes == 8 ? "avx" : "sse2";
#else
  return "none (ordinary stores)";
#endif
}

}  // namespace fedhpc
