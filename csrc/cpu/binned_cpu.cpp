// CPU kernel of fedhpc.reproducible_sum's deposit: terms added to three bins of base-2^32
// digits at each element's top position (fedhpc/ops/reference.py: binned_add_ is the contract,
// and the module docstring of fedhpc/reproducible_sum.py the method).
//
// Every step is exact or one IEEE rounding the reference does too (the term times alpha), so the
// bins equal the reference's bit for bit: scaling by powers of two, the digit cut towards zero
// (|u| < 2^32, so through int64 exactly; a -0 digit from torch.trunc adds like +0) and the bin
// additions (integers below 2^53). Elements are independent: any split over threads gives the
// same bits. One pass over the data instead of the reference's fifteen.
#include "../fedhpc_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

}  // namespace

void binned_add_cpu(const Tensor& terms, double alpha, Tensor& bins, Tensor& top, int64_t start) {
  const int64_t n = terms.numel(), stride = bins.stride(0);
  double* b = bins.data_ptr<double>() + start;
  int8_t* t = top.data_ptr<int8_t>() + start;
  AT_DISPATCH_FLOATING_TYPES(terms.scalar_type(), "binned_add_cpu", [&] {
    const scalar_t* x = terms.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
      binned_add_range<scalar_t>(x + lo, alpha, b + lo, b + stride + lo, b + 2 * stride + lo, t + lo, hi - lo);
    });
  });
}

}  // namespace fedhpc
