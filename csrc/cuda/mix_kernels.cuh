// Launchers of the CUDA kernels, in plain CUDA C++: no torch header, so the .cu compiles with
// nvcc alone (tests/test_ops.py does, on machines whose torch has no CUDA) and cannot rot.
// The torch-facing side is cuda/ops_cuda.cpp. One launch per call, whatever the number of
// rows, clients or segments. Pointers are to row-major data with unit column stride.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fedhpc {
namespace cuda {

// out (rows, cols) = wa * a + wb * b[row or 0]   (b == nullptr: out = wa * a).
template <typename T>
struct MixPair {
  T* out;
  const T* a;
  const T* b;
  int64_t rows, cols, b_rows;  // b_rows: 1 (broadcast) or rows
};

// Transpose: ga = wa * g; gb = wb * g (b_rows == rows) or wb * (sum over rows of g) (b_rows == 1).
template <typename T>
struct MixPairT {
  const T* g;
  T* ga;  // may be nullptr
  T* gb;  // may be nullptr
  int64_t rows, cols, b_rows;
};

template <typename T>
cudaError_t launch_mix_forward(MixPair<T> x, MixPair<T> y, T wa, T wb, cudaStream_t stream);

template <typename T>
cudaError_t launch_mix_backward(MixPairT<T> x, MixPairT<T> y, T wa, T wb, cudaStream_t stream);

// s[i] = lam * sum_j g[i, j] * xbar[i or 0, j].
template <typename T>
cudaError_t launch_l3_forward(const T* g, const T* xbar, T* s, int64_t rows, int64_t cols, int64_t x_rows, T lam,
                              cudaStream_t stream);

// c_i = go[i] * lam; gg[i, j] = c_i * xbar[i or 0, j]; gx = c_i * g[i, j] (x_rows == rows) or
// sum_i c_i * g[i, j] (x_rows == 1). gg / gx may be nullptr.
template <typename T>
cudaError_t launch_l3_backward(const T* go, const T* g, const T* xbar, T* gg, T* gx, int64_t rows, int64_t cols,
                               int64_t x_rows, T lam, cudaStream_t stream);

// out[c, p] = l * a[c, p] + (1 - l) * b[c, p], l = lam[c or 0, s], off[s] <= p < off[s + 1].
// Row strides in elements (b_rs may be 0); off has nseg + 1 entries on the device.
template <typename T>
cudaError_t launch_segment_mix(const T* a, int64_t a_rs, const T* b, int64_t b_rs, T* out, int64_t o_rs,
                               const int64_t* off, int64_t nseg, const T* lam, int64_t lam_rows, int64_t rows,
                               int64_t cols, cudaStream_t stream);

// The deposit of fedhpc.reproducible_sum (contract: fedhpc/ops/reference.py binned_add_): alpha *
// terms[i] into the three float64 bins bins[k * bin_stride + i] at top position top[i] (raised
// first when the term needs it; positions start at p_min).
template <typename T>
cudaError_t launch_binned_add(const T* terms, double alpha, double* bins, int64_t bin_stride, int8_t* top, int64_t n,
                              int p_min, cudaStream_t stream);

}  // namespace cuda
}  // namespace fedhpc
