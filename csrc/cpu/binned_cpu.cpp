// CPU kernel of fedhpc.reproducible_sum's deposit: terms added to three bins of base-2^32
// digits at each element's top position (fedhpc/ops/reference.py: binned_add_ is the contract,
// and the module docstring of fedhpc/reproducible_sum.py the method).
//
// Every step is exact or one IEEE rounding the reference does too (the term times alpha), so the
// bins equal the reference's bit for bit: scaling by powers of two, the digit cut towards zero
// (|u| < 2^32, so through int64 exactly; a -0 digit from torch.trunc adds like +0) and the bin
// additions (integers below 2^53). Elements are independent: any split over threads gives the
// same bits. One pass over the data instead of the reference's fifteen.
//
// Where the processor has AVX2 (picked once at load; FEDHPC_NO_SIMD keeps the scalar loop), four
// elements go through at once: the digit cut is a rounding towards zero (vroundpd) instead of the
// scalar loop's trip through int64: the same value (|u| < 2^32), except -0 where that trip gives
// +0, which adds to a bin alike; and the shift of the bins is a select per lane. A group of four holding
// an infinite or NaN term takes the scalar loop. 3.9-5.2x the scalar loop on one thread in a
// stand-alone test (26k to 4M elements); figures in benchmarks/RESULTS.md.
#include "../fedhpc_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FEDHPC_BINNED_AVX2 1
#endif

namespace fedhpc {
namespace {

constexpr int64_t kGrain = 32768;
constexpr int kPMin = kBinnedBins;          // lowest top position (reference: P_MIN)
constexpr double kRadix = 4294967296.0;     // 2^32: one digit

// 1 / g(p) = 2^(1023 - 32 p), from the bits.
inline double inverse_grid(int p) {
  const uint64_t bits = (uint64_t{2046} << 52) - (static_cast<uint64_t>(p) << 57);
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

template <typename T>
void binned_add_range(const T* __restrict terms, double alpha, double* __restrict b0, double* __restrict b1,
                      double* __restrict b2, int8_t* __restrict top, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    double c = static_cast<double>(terms[i]);
    if (alpha != 1.0) c = c * alpha;
    uint64_t bits;
    std::memcpy(&bits, &c, sizeof bits);
    const int p = std::max(static_cast<int>((bits >> 57) & 63), kPMin);
    if (p > top[i]) {  // shift the bins down, dropping what falls off the last
      const int by = std::min(p - static_cast<int>(top[i]), kBinnedBins);
      const double o0 = b0[i], o1 = b1[i];
      b2[i] = by == 1 ? o1 : by == 2 ? o0 : 0.0;
      b1[i] = by == 1 ? o0 : 0.0;
      b0[i] = 0.0;
      top[i] = static_cast<int8_t>(p);
    }
    if (!std::isfinite(c)) {  // inf / NaN: at position 63, into the top bin as they are
      b0[i] += c;
      continue;
    }
    double u = c * inverse_grid(top[i]);
    double d = static_cast<double>(static_cast<int64_t>(u));
    b0[i] += d;
    u = (u - d) * kRadix;
    d = static_cast<double>(static_cast<int64_t>(u));
    b1[i] += d;
    u = (u - d) * kRadix;
    b2[i] += static_cast<double>(static_cast<int64_t>(u));
  }
}

#ifdef FEDHPC_BINNED_AVX2
#define FEDHPC_AVX2 __attribute__((target("avx2")))

FEDHPC_AVX2 inline __m256d load4(const float* x) { return _mm256_cvtps_pd(_mm_loadu_ps(x)); }
FEDHPC_AVX2 inline __m256d load4(const double* x) { return _mm256_loadu_pd(x); }

// binned_add_range four elements at a time; the same bits.
template <typename T>
FEDHPC_AVX2 void binned_add_range_avx2(const T* __restrict terms, double alpha, double* __restrict b0,
                                       double* __restrict b1, double* __restrict b2, int8_t* __restrict top,
                                       int64_t n) {
  const bool scale = alpha != 1.0;  // as the scalar loop: a NaN's bits pass unmultiplied when alpha is 1
  const __m256d valpha = _mm256_set1_pd(alpha), radix = _mm256_set1_pd(kRadix);
  const __m256i low6 = _mm256_set1_epi64x(63), pmin = _mm256_set1_epi64x(kPMin), one = _mm256_set1_epi64x(1),
                two = _mm256_set1_epi64x(2), exponent = _mm256_set1_epi64x(0x7ff0000000000000LL),
                grid_base = _mm256_set1_epi64x(int64_t{2046} << 52);
  // byte 0 of each 64-bit lane to bytes 0, 1 of its 128-bit half (the new tops, below 64)
  const __m256i lane_bytes = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                              0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  constexpr int kCut = _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    __m256d c = load4(terms + i);
    if (scale) c = _mm256_mul_pd(c, valpha);
    const __m256i bits = _mm256_castpd_si256(c);
    const __m256i nonfinite = _mm256_cmpeq_epi64(_mm256_and_si256(bits, exponent), exponent);
    if (!_mm256_testz_si256(nonfinite, nonfinite)) {
      binned_add_range(terms + i, alpha, b0 + i, b1 + i, b2 + i, top + i, 4);
      continue;
    }
    // positions and tops are below 64 in 64-bit lanes: 32-bit max is 64-bit max here
    const __m256i p = _mm256_max_epi32(_mm256_and_si256(_mm256_srli_epi64(bits, 57), low6), pmin);
    int32_t top4;
    std::memcpy(&top4, top + i, 4);
    const __m256i t = _mm256_cvtepi8_epi64(_mm_cvtsi32_si128(top4));
    __m256i new_top = t;
    __m256d o0 = _mm256_loadu_pd(b0 + i), o1 = _mm256_loadu_pd(b1 + i), o2 = _mm256_loadu_pd(b2 + i);
    const __m256i raise = _mm256_cmpgt_epi64(p, t);
    if (!_mm256_testz_si256(raise, raise)) {  // shift each raised lane's bins down by (p - top)
      new_top = _mm256_max_epi32(p, t);
      const __m256i by = _mm256_sub_epi64(new_top, t);
      const __m256d keep = _mm256_castsi256_pd(_mm256_cmpeq_epi64(by, _mm256_setzero_si256()));
      const __m256d by1 = _mm256_castsi256_pd(_mm256_cmpeq_epi64(by, one));
      const __m256d by2 = _mm256_castsi256_pd(_mm256_cmpeq_epi64(by, two));
      const __m256d n2 = _mm256_or_pd(_mm256_and_pd(keep, o2),
                                      _mm256_or_pd(_mm256_and_pd(by1, o1), _mm256_and_pd(by2, o0)));
      o1 = _mm256_or_pd(_mm256_and_pd(keep, o1), _mm256_and_pd(by1, o0));
      o0 = _mm256_and_pd(keep, o0);
      o2 = n2;
      const __m256i packed = _mm256_shuffle_epi8(new_top, lane_bytes);
      const int32_t new4 = (_mm_cvtsi128_si32(_mm256_castsi256_si128(packed)) & 0xffff) |
                           (_mm_cvtsi128_si32(_mm256_extracti128_si256(packed, 1)) << 16);
      std::memcpy(top + i, &new4, 4);
    }
    // 1 / g(top) from the bits, then the three digits
    __m256d u = _mm256_mul_pd(c, _mm256_castsi256_pd(_mm256_sub_epi64(grid_base, _mm256_slli_epi64(new_top, 57))));
    __m256d d = _mm256_round_pd(u, kCut);
    o0 = _mm256_add_pd(o0, d);
    u = _mm256_mul_pd(_mm256_sub_pd(u, d), radix);
    d = _mm256_round_pd(u, kCut);
    o1 = _mm256_add_pd(o1, d);
    u = _mm256_mul_pd(_mm256_sub_pd(u, d), radix);
    o2 = _mm256_add_pd(o2, _mm256_round_pd(u, kCut));
    _mm256_storeu_pd(b0 + i, o0);
    _mm256_storeu_pd(b1 + i, o1);
    _mm256_storeu_pd(b2 + i, o2);
  }
  binned_add_range(terms + i, alpha, b0 + i, b1 + i, b2 + i, top + i, n - i);
}

bool use_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && cpu_simd_allowed();
  return yes;
}
#endif

}  // namespace

const char* binned_add_cpu_isa() {
#ifdef FEDHPC_BINNED_AVX2
  if (use_avx2()) return "avx2";
#endif
  return "scalar";
}

void binned_add_cpu(const Tensor& terms, double alpha, Tensor& bins, Tensor& top, int64_t start) {
  const int64_t n = terms.numel(), stride = bins.stride(0);
  double* b = bins.data_ptr<double>() + start;
  int8_t* t = top.data_ptr<int8_t>() + start;
  AT_DISPATCH_FLOATING_TYPES(terms.scalar_type(), "binned_add_cpu", [&] {
    const scalar_t* x = terms.data_ptr<scalar_t>();
    auto range = &binned_add_range<scalar_t>;
#ifdef FEDHPC_BINNED_AVX2
    if (use_avx2()) range = &binned_add_range_avx2<scalar_t>;
#endif
    at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
      range(x + lo, alpha, b + lo, b + stride + lo, b + 2 * stride + lo, t + lo, hi - lo);
    });
  });
}

}  // namespace fedhpc
