// CUDA kernels of fedhpc's native ops (declared in mix_kernels.cuh; maths in fedhpc/ops/).
//
// * One launch per call: the input pair and the label pair of FedMix share a launch, and the
//   segmented mixup covers every client and every segment in one grid.
// * Coalesced: consecutive threads touch consecutive columns; column reductions run over
//   tiles of 32 columns x 8 row lanes, so a warp reads 32 consecutive values of a row.
// * Deterministic: every reduction sums in an order fixed by the shapes (row lanes, then a
//   fixed combine), never with atomics.
// * Arithmetic with explicitly rounded intrinsics (__fmul_rn, __fadd_rn, ...) so nvcc cannot
//   contract a*b + c*d into an FMA: elementwise results equal PyTorch's separate kernels.
#include "mix_kernels.cuh"

namespace fedhpc {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTileCols = 32;      // column tile of the transposed / reducing kernels
constexpr int kRowLanes = 8;       // row lanes per column tile (blockDim.y)
constexpr int kItems = 4;          // elements per thread per tile in segment_mix
constexpr int64_t kMaxBlocks = 4096;
constexpr int64_t kSegBlocks = 1024;
constexpr int kSharedOffsets = 2048;  // offsets cached in shared memory up to this many entries

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }

inline int64_t blocks_for(int64_t n, int64_t per_block, int64_t cap) {
  const int64_t b = (n + per_block - 1) / per_block;
  return b < 1 ? 1 : (b > cap ? cap : b);
}

template <typename T>
__device__ __forceinline__ void mix_at(const MixPair<T>& p, int64_t i, T wa, T wb) {
  if (p.b == nullptr) {
    p.out[i] = mul_rn(wa, p.a[i]);
    return;
  }
  const int64_t bi = p.b_rows == 1 ? i % p.cols : i;
  p.out[i] = add_rn(mul_rn(wa, p.a[i]), mul_rn(wb, p.b[bi]));
}

template <typename T>
__global__ void mix_forward_kernel(MixPair<T> x, MixPair<T> y, T wa, T wb) {
  const int64_t nx = x.rows * x.cols, n = nx + y.rows * y.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < nx) {
      mix_at(x, i, wa, wb);
    } else {
      mix_at(y, i - nx, wa, wb);
    }
  }
}

// Combines the row lanes of a column tile in lane order; thread (tx, 0) gets the column total.
template <typename T>
__device__ __forceinline__ T combine_lanes(T acc, T (*red)[kTileCols]) {
  red[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  T s = red[0][threadIdx.x];
  if (threadIdx.y == 0) {
    for (int k = 1; k < kRowLanes; ++k) s = add_rn(s, red[k][threadIdx.x]);
  }
  __syncthreads();  // red is reused by the next tile
  return s;
}

template <typename T>
__device__ void mix_transpose_tile(const MixPairT<T>& p, int64_t tile, T wa, T wb, T (*red)[kTileCols]) {
  const int64_t j = tile * kTileCols + threadIdx.x;
  const bool col = j < p.cols;
  const bool reduce = p.gb != nullptr && p.b_rows == 1;  // uniform over the block
  T acc = T(0);
  if (col) {
    for (int64_t r = threadIdx.y; r < p.rows; r += kRowLanes) {
      const int64_t i = r * p.cols + j;
      const T v = p.g[i];
      if (p.ga != nullptr) p.ga[i] = mul_rn(wa, v);
      if (reduce) {
        acc = add_rn(acc, v);
      } else if (p.gb != nullptr) {
        p.gb[i] = mul_rn(wb, v);
      }
    }
  }
  if (reduce) {
    const T s = combine_lanes(acc, red);
    if (threadIdx.y == 0 && col) p.gb[j] = mul_rn(wb, s);
  }
}

template <typename T>
__global__ void mix_backward_kernel(MixPairT<T> x, MixPairT<T> y, T wa, T wb) {
  __shared__ T red[kRowLanes][kTileCols];
  const int64_t tx = (x.cols + kTileCols - 1) / kTileCols, ty = (y.cols + kTileCols - 1) / kTileCols;
  for (int64_t t = blockIdx.x; t < tx + ty; t += gridDim.x) {
    if (t < tx) {
      mix_transpose_tile(x, t, wa, wb, red);
    } else {
      mix_transpose_tile(y, t - tx, wa, wb, red);
    }
  }
}

template <typename T>
__global__ void l3_forward_kernel(const T* g, const T* xbar, T* s, int64_t rows, int64_t cols, int64_t x_rows,
                                  T lam) {
  __shared__ T red[kThreads];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* gr = g + r * cols;
    const T* xr = xbar + (x_rows == 1 ? 0 : r) * cols;
    T acc = T(0);
    for (int64_t j = threadIdx.x; j < cols; j += kThreads) acc = add_rn(acc, mul_rn(gr[j], xr[j]));
    red[threadIdx.x] = acc;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {  // fixed tree: deterministic
      if (threadIdx.x < half) red[threadIdx.x] = add_rn(red[threadIdx.x], red[threadIdx.x + half]);
      __syncthreads();
    }
    if (threadIdx.x == 0) s[r] = mul_rn(lam, red[0]);
    __syncthreads();
  }
}

template <typename T>
__global__ void l3_backward_kernel(const T* go, const T* g, const T* xbar, T* gg, T* gx, int64_t rows, int64_t cols,
                                   int64_t x_rows, T lam) {
  __shared__ T red[kRowLanes][kTileCols];
  const bool reduce = gx != nullptr && x_rows == 1;
  const int64_t tiles = (cols + kTileCols - 1) / kTileCols;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t j = t * kTileCols + threadIdx.x;
    T acc = T(0);
    if (j < cols) {
      for (int64_t r = threadIdx.y; r < rows; r += kRowLanes) {
        const T c = mul_rn(go[r], lam);  // autograd scales the incoming gradient before it fans out
        const int64_t i = r * cols + j;
        if (gg != nullptr) gg[i] = mul_rn(c, xbar[(x_rows == 1 ? 0 : r) * cols + j]);
        if (gx != nullptr) {
          const T v = mul_rn(c, g[i]);
          if (reduce) {
            acc = add_rn(acc, v);
          } else {
            gx[i] = v;
          }
        }
      }
    }
    if (reduce) {
      const T s = combine_lanes(acc, red);
      if (threadIdx.y == 0 && j < cols) gx[j] = s;
    }
  }
}

template <typename T>
__global__ void segment_mix_kernel(const T* a, int64_t a_rs, const T* b, int64_t b_rs, T* out, int64_t o_rs,
                                   const int64_t* off_global, int64_t nseg, const T* lam, int64_t lam_rows,
                                   int64_t rows, int64_t cols) {
  __shared__ int64_t off_shared[kSharedOffsets];
  const int64_t* off = off_global;
  if (nseg + 1 <= kSharedOffsets) {
    for (int64_t s = threadIdx.x; s <= nseg; s += blockDim.x) off_shared[s] = off_global[s];
    __syncthreads();
    off = off_shared;
  }
  constexpr int64_t tile = static_cast<int64_t>(kThreads) * kItems;
  const int64_t tiles_per_row = (cols + tile - 1) / tile;
  for (int64_t t = blockIdx.x; t < rows * tiles_per_row; t += gridDim.x) {
    const int64_t r = t / tiles_per_row;
    const int64_t p_first = (t - r * tiles_per_row) * tile + threadIdx.x;
    if (p_first >= cols) continue;
    // Last s with off[s] <= p_first: a binary search once, then a walk for the later items.
    int64_t lo = 0, hi = nseg - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (off[mid] <= p_first) lo = mid; else hi = mid - 1;
    }
    int64_t s = lo;
    const T* lr = lam + (lam_rows == 1 ? 0 : r) * nseg;
    T va[kItems], vb[kItems], vl[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {  // every load before any store: in place (out == a) stays safe
      const int64_t p = p_first + k * kThreads;
      if (p < cols) {
        while (off[s + 1] <= p) ++s;
        vl[k] = lr[s];
        va[k] = a[r * a_rs + p];
        vb[k] = b[r * b_rs + p];
      }
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t p = p_first + k * kThreads;
      if (p < cols) {
        const T om = sub_rn(T(1), vl[k]);
        out[r * o_rs + p] = add_rn(mul_rn(vl[k], va[k]), mul_rn(om, vb[k]));
      }
    }
  }
}

}  // namespace

template <typename T>
cudaError_t launch_mix_forward(MixPair<T> x, MixPair<T> y, T wa, T wb, cudaStream_t stream) {
  const int64_t n = x.rows * x.cols + y.rows * y.cols;
  if (n == 0) return cudaSuccess;
  mix_forward_kernel<T><<<blocks_for(n, kThreads, kMaxBlocks), kThreads, 0, stream>>>(x, y, wa, wb);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_mix_backward(MixPairT<T> x, MixPairT<T> y, T wa, T wb, cudaStream_t stream) {
  const int64_t tiles = (x.cols + kTileCols - 1) / kTileCols + (y.cols + kTileCols - 1) / kTileCols;
  if (tiles == 0) return cudaSuccess;
  mix_backward_kernel<T><<<blocks_for(tiles, 1, kMaxBlocks), dim3(kTileCols, kRowLanes), 0, stream>>>(x, y, wa, wb);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_l3_forward(const T* g, const T* xbar, T* s, int64_t rows, int64_t cols, int64_t x_rows, T lam,
                              cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  l3_forward_kernel<T><<<blocks_for(rows, 1, kMaxBlocks), kThreads, 0, stream>>>(g, xbar, s, rows, cols, x_rows, lam);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_l3_backward(const T* go, const T* g, const T* xbar, T* gg, T* gx, int64_t rows, int64_t cols,
                               int64_t x_rows, T lam, cudaStream_t stream) {
  const int64_t tiles = (cols + kTileCols - 1) / kTileCols;
  if (tiles == 0) return cudaSuccess;  // rows == 0 still runs: a broadcast mean's gradient is then 0
  l3_backward_kernel<T><<<blocks_for(tiles, 1, kMaxBlocks), dim3(kTileCols, kRowLanes), 0, stream>>>(
      go, g, xbar, gg, gx, rows, cols, x_rows, lam);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_segment_mix(const T* a, int64_t a_rs, const T* b, int64_t b_rs, T* out, int64_t o_rs,
                               const int64_t* off, int64_t nseg, const T* lam, int64_t lam_rows, int64_t rows,
                               int64_t cols, cudaStream_t stream) {
  const int64_t tiles = rows * ((cols + kThreads * kItems - 1) / (kThreads * kItems));
  if (tiles == 0) return cudaSuccess;
  segment_mix_kernel<T><<<blocks_for(tiles, 1, kSegBlocks), kThreads, 0, stream>>>(
      a, a_rs, b, b_rs, out, o_rs, off, nseg, lam, lam_rows, rows, cols);
  return cudaGetLastError();
}

#define FEDHPC_INSTANTIATE(T)                                                                                     \
  template cudaError_t launch_mix_forward<T>(MixPair<T>, MixPair<T>, T, T, cudaStream_t);                        \
  template cudaError_t launch_mix_backward<T>(MixPairT<T>, MixPairT<T>, T, T, cudaStream_t);                     \
  template cudaError_t launch_l3_forward<T>(const T*, const T*, T*, int64_t, int64_t, int64_t, T, cudaStream_t); \
  template cudaError_t launch_l3_backward<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t, int64_t, T, \
                                             cudaStream_t);                                                      \
  template cudaError_t launch_segment_mix<T>(const T*, int64_t, const T*, int64_t, T*, int64_t, const int64_t*,  \
                                             int64_t, const T*, int64_t, int64_t, int64_t, cudaStream_t);
FEDHPC_INSTANTIATE(float)
FEDHPC_INSTANTIATE(double)
#undef FEDHPC_INSTANTIATE

}  // namespace cuda
}  // namespace fedhpc
