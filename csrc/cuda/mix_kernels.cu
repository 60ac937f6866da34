// CUDA kernels of fedhpc's native ops (declared in mix_kernels.cuh; maths in fedhpc/ops/).
//
// * One launch per call: the input pair and the label pair of FedMix share a launch, and the
//   segmented mixup covers every client and every segment in one grid.
// * Bandwidth first: elementwise work runs over a 2-D grid (rows x column vectors, no index
//   division per element) in 16-byte vectors (float4 / double2) wherever the row starts are
//   16-byte aligned and rows hold whole vectors, scalars otherwise; grids are sized to fill the
//   GPU once and loop (results never depend on the grid). Measured on an H100 (bench_ops.py),
//   the earlier scalar, 1-D versions reached 0.53-0.76 of copy bandwidth.
// * Coalesced: consecutive threads touch consecutive vectors; column reductions (only the
//   gradient of a mean broadcast over the batch needs one) run over tiles of 32 columns x 8
//   row lanes, so a warp reads 32 consecutive values of a row.
// * Deterministic: every reduction sums in an order fixed by the shapes (row lanes, then a
//   fixed combine), never with atomics.
// * Arithmetic with explicitly rounded intrinsics (__fmul_rn, __fadd_rn, ...) so nvcc cannot
//   contract a*b + c*d into an FMA: elementwise results equal PyTorch's separate kernels.
#include "mix_kernels.cuh"

// Every launch goes through this macro so that the tests can run these kernels on a machine
// without a GPU, under tests/cuda_emulation/ (which defines it); nvcc sees the usual syntax.
#ifndef FEDHPC_LAUNCH
#define FEDHPC_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<grid, block, 0, stream>>>
#endif

namespace fedhpc {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTileCols = 32;      // column tile of the transposed / reducing kernels
constexpr int kRowLanes = 8;       // row lanes per column tile (blockDim.y)
constexpr int kItems = 4;          // elements per thread per tile in segment_mix
constexpr int kSharedOffsets = 2048;  // offsets cached in shared memory up to this many entries

// Grid caps: 1-D grids of the reducing kernels stop at 4096 blocks, and gridDim.y may not pass
// CUDA's 65535; grid-stride loops cover the rest. The tests' CUDA emulation lowers both
// (FEDHPC_GRID_CAP) so that small inputs run every one of those loops more than once.
#ifndef FEDHPC_GRID_CAP
#define FEDHPC_GRID_CAP(limit) (limit)
#endif
inline int64_t max_blocks() { return FEDHPC_GRID_CAP(4096); }
inline int64_t max_grid_y() { return FEDHPC_GRID_CAP(65535); }

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

// 16-byte vectors: one load instruction moves 4 floats or 2 doubles (V = 1: plain scalars).
template <typename T, int V>
struct VecT {
  using type = T;
};
template <>
struct VecT<float, 4> {
  using type = float4;
};
template <>
struct VecT<double, 2> {
  using type = double2;
};
template <typename T, int V>
__device__ __forceinline__ T& lane(typename VecT<T, V>::type& v, int k) {
  return reinterpret_cast<T*>(&v)[k];
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Blocks that fill the current GPU once (8 resident blocks of kThreads per SM); grid-stride
// loops cover the rest. Only elementwise kernels size their grids from this: their results
// do not depend on the grid.
inline int64_t resident_blocks() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms < 1) {
    cudaGetLastError();  // clear it: the launch that follows reports real errors
    sms = 80;
  }
  return static_cast<int64_t>(sms) * (2048 / kThreads);
}

// A 2-D grid over (column vectors, rows): blockIdx.y strides rows, blockIdx.x the vectors of
// a row, so no thread divides a flat index by the row length.
inline dim3 rows_grid(int64_t rows, int64_t vecs_per_row, int64_t per_block, int64_t resident) {
  const int64_t gy = blocks_for(rows, 1, max_grid_y());
  const int64_t gx = blocks_for(vecs_per_row, per_block, (resident + gy - 1) / gy);
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
}
inline dim3 rows_grid(int64_t rows, int64_t vecs_per_row, int64_t per_block) {
  return rows_grid(rows, vecs_per_row, per_block, resident_blocks());
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

// --------------------------------------------------------------- row kernels (vectorised)
// Rows [0, x.rows) are x's, rows [x.rows, x.rows + y.rows) are y's: one launch for both pairs;
// x (the inputs, nearly all the bytes) moves in 16-byte vectors when VX > 1, y in scalars.
template <typename T, int V>
__device__ __forceinline__ void mix_row(const MixPair<T>& p, int64_t r, T wa, T wb) {
  using VT = typename VecT<T, V>::type;
  const int64_t nv = p.cols / V;
  const VT* a = reinterpret_cast<const VT*>(p.a + r * p.cols);
  const VT* b = p.b == nullptr ? nullptr : reinterpret_cast<const VT*>(p.b + (p.b_rows == 1 ? 0 : r) * p.cols);
  VT* o = reinterpret_cast<VT*>(p.out + r * p.cols);
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nv;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    VT av = a[v], ov;
    if (b != nullptr) {
      VT bv = b[v];
#pragma unroll
      for (int k = 0; k < V; ++k)
        lane<T, V>(ov, k) = add_rn(mul_rn(wa, lane<T, V>(av, k)), mul_rn(wb, lane<T, V>(bv, k)));
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) lane<T, V>(ov, k) = mul_rn(wa, lane<T, V>(av, k));
    }
    o[v] = ov;
  }
}

// ga = wa * g and gb = wb * g row by row (no column sum: b has a row per row of g).
template <typename T, int V>
__device__ __forceinline__ void scale_row(const MixPairT<T>& p, int64_t r, T wa, T wb) {
  using VT = typename VecT<T, V>::type;
  const int64_t nv = p.cols / V;
  const VT* g = reinterpret_cast<const VT*>(p.g + r * p.cols);
  VT* ga = p.ga == nullptr ? nullptr : reinterpret_cast<VT*>(p.ga + r * p.cols);
  VT* gb = p.gb == nullptr ? nullptr : reinterpret_cast<VT*>(p.gb + r * p.cols);
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nv;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    VT gv = g[v], o;
    if (ga != nullptr) {
#pragma unroll
      for (int k = 0; k < V; ++k) lane<T, V>(o, k) = mul_rn(wa, lane<T, V>(gv, k));
      ga[v] = o;
    }
    if (gb != nullptr) {
#pragma unroll
      for (int k = 0; k < V; ++k) lane<T, V>(o, k) = mul_rn(wb, lane<T, V>(gv, k));
      gb[v] = o;
    }
  }
}

struct MixRow {
  template <typename T, int V>
  __device__ static void run(const MixPair<T>& p, int64_t r, T wa, T wb) { mix_row<T, V>(p, r, wa, wb); }
};
struct ScaleRow {
  template <typename T, int V>
  __device__ static void run(const MixPairT<T>& p, int64_t r, T wa, T wb) { scale_row<T, V>(p, r, wa, wb); }
};

// The forward and the elementwise backward of a pair of pairs: rows [0, x.rows) are x's, the
// rest y's; x in VX-wide vectors, y (the labels, few bytes) in scalars.
template <typename Row, typename Pair, typename T, int VX>
__global__ void pair_rows_kernel(Pair x, Pair y, T wa, T wb) {
  for (int64_t r = blockIdx.y; r < x.rows + y.rows; r += gridDim.y) {
    if (r < x.rows) {
      Row::template run<T, VX>(x, r, wa, wb);
    } else {
      Row::template run<T, 1>(y, r - x.rows, wa, wb);
    }
  }
}

// l3's backward without a column sum: gg[r] = c_r * xbar[r or 0], gx[r] = c_r * g[r].
template <typename T, int V>
__global__ void l3_backward_rows_kernel(const T* go, const T* g, const T* xbar, T* gg, T* gx, int64_t rows,
                                        int64_t cols, int64_t x_rows, T lam) {
  using VT = typename VecT<T, V>::type;
  const int64_t nv = cols / V;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T c = mul_rn(go[r], lam);  // autograd scales the incoming gradient before it fans out
    const VT* xr = reinterpret_cast<const VT*>(xbar + (x_rows == 1 ? 0 : r) * cols);
    const VT* gr = reinterpret_cast<const VT*>(g + r * cols);
    for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < nv;
         v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      VT o;
      if (gg != nullptr) {
        const VT xv = xr[v];
#pragma unroll
        for (int k = 0; k < V; ++k) lane<T, V>(o, k) = mul_rn(c, lane<T, V>(const_cast<VT&>(xv), k));
        reinterpret_cast<VT*>(gg + r * cols)[v] = o;
      }
      if (gx != nullptr) {
        const VT gv = gr[v];
#pragma unroll
        for (int k = 0; k < V; ++k) lane<T, V>(o, k) = mul_rn(c, lane<T, V>(const_cast<VT&>(gv), k));
        reinterpret_cast<VT*>(gx + r * cols)[v] = o;
      }
    }
  }
}

// segment_mix over a 2-D grid, 16-byte vectors when every row start is aligned. blockIdx.y takes
// groups of group_rows consecutive rows. Each thread takes kItems vectors kThreads apart
// (coalesced), loads them all before it stores any (so out == a or out == b in place stays
// safe), finds the segment of its first element by a binary search over the offsets (in shared
// memory when they fit) and walks forward.
template <typename T, int V, bool SharedB>
__global__ void segment_mix_rows_kernel(const T* a, int64_t a_rs, const T* b, int64_t b_rs, T* out, int64_t o_rs,
                                        const int64_t* off_global, int64_t nseg, const T* lam, int64_t lam_rows,
                                        int64_t rows, int64_t cols, int64_t group_rows) {
  using VT = typename VecT<T, V>::type;
  __shared__ int64_t off_shared[kSharedOffsets];
  const int64_t* off = off_global;
  if (nseg + 1 <= kSharedOffsets) {
    for (int64_t s = threadIdx.x; s <= nseg; s += blockDim.x) off_shared[s] = off_global[s];
    __syncthreads();
    off = off_shared;
  }
  const int64_t nv = cols / V;
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * kItems;
  // SharedB (one b row for every row, e.g. the global state against C clients): the rows of a
  // group run inside, so each b vector is read once per group and kept in registers for its
  // rows (the rows-outside order re-read b per row: 0.70 of copy bandwidth once b left L2).
  // Without it a group is one row, known at compile time: the row loop costs no registers
  // (a run-time group size took the float4 kernel from 62 to 72, 4 to 3 blocks per SM).
  const int64_t per_group = SharedB ? group_rows : 1;
  const int64_t groups = SharedB ? (rows + per_group - 1) / per_group : rows;
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    const int64_t r_begin = g * per_group;
    const int64_t r_end = !SharedB ? r_begin + 1 : (r_begin + per_group < rows ? r_begin + per_group : rows);
    for (int64_t v0 = blockIdx.x * chunk + threadIdx.x; v0 < nv; v0 += static_cast<int64_t>(gridDim.x) * chunk) {
      const int64_t p0 = v0 * V;
      int64_t lo = 0, hi = nseg - 1;  // last s with off[s] <= p0
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (off[mid] <= p0) lo = mid; else hi = mid - 1;
      }
      VT vb[kItems];
      if (SharedB) {
#pragma unroll
        for (int k = 0; k < kItems; ++k) {
          const int64_t v = v0 + k * static_cast<int64_t>(blockDim.x);
          if (v < nv) vb[k] = reinterpret_cast<const VT*>(b)[v];
        }
      }
      for (int64_t r = r_begin; r < r_end; ++r) {
        const VT* ar = reinterpret_cast<const VT*>(a + r * a_rs);
        VT* orow = reinterpret_cast<VT*>(out + r * o_rs);
        const T* lr = lam + (lam_rows == 1 ? 0 : r) * nseg;
        int64_t s = lo;
        VT va[kItems];
#pragma unroll
        for (int k = 0; k < kItems; ++k) {  // every load before any store: in place stays safe
          const int64_t v = v0 + k * static_cast<int64_t>(blockDim.x);
          if (v < nv) {
            va[k] = ar[v];
            if (!SharedB) vb[k] = reinterpret_cast<const VT*>(b + r * b_rs)[v];
          }
        }
#pragma unroll
        for (int k = 0; k < kItems; ++k) {
          const int64_t v = v0 + k * static_cast<int64_t>(blockDim.x);
          if (v < nv) {
            VT o;
#pragma unroll
            for (int j = 0; j < V; ++j) {
              const int64_t p = v * V + j;
              while (off[s + 1] <= p) ++s;
              const T l = lr[s];
              lane<T, V>(o, j) =
                  add_rn(mul_rn(l, lane<T, V>(va[k], j)), mul_rn(sub_rn(T(1), l), lane<T, V>(vb[k], j)));
            }
            orow[v] = o;
          }
        }
      }
    }
  }
}

template <typename Row, typename Pair, typename T>
cudaError_t launch_pair_rows(const Pair& x, const Pair& y, bool vec, T wa, T wb, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const int64_t xv = vec ? x.cols / V : x.cols;
  const dim3 grid = rows_grid(x.rows + y.rows, xv > y.cols ? xv : y.cols, kThreads);
  if (vec) {
    FEDHPC_LAUNCH(grid, kThreads, stream, pair_rows_kernel<Row, Pair, T, V>)(x, y, wa, wb);
  } else {
    FEDHPC_LAUNCH(grid, kThreads, stream, pair_rows_kernel<Row, Pair, T, 1>)(x, y, wa, wb);
  }
  return cudaGetLastError();
}

// The deposit of fedhpc.reproducible_sum: the CPU kernel's loop (cpu/binned_cpu.cpp, which says
// why every step is exact or the reference's one rounding) as one thread per element. Elements
// are independent, so any grid gives the same bits; the finiteness test reads the exponent bits.
__device__ __forceinline__ double binned_inverse_grid(int p) {  // 1 / g(p) = 2^(1023 - 32 p)
  return __longlong_as_double(static_cast<long long>((uint64_t{2046} << 52) - (static_cast<uint64_t>(p) << 57)));
}

template <typename T>
__global__ void binned_add_kernel(const T* __restrict__ terms, double alpha, double* __restrict__ b0,
                                  double* __restrict__ b1, double* __restrict__ b2, int8_t* __restrict__ top,
                                  int64_t n, int p_min) {
  constexpr double kRadix = 4294967296.0;  // 2^32: one digit
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    double c = static_cast<double>(terms[i]);
    if (alpha != 1.0) c = __dmul_rn(c, alpha);
    const uint64_t bits = static_cast<uint64_t>(__double_as_longlong(c));
    int p = static_cast<int>((bits >> 57) & 63);
    p = p < p_min ? p_min : p;
    int t = top[i];
    double o0 = b0[i], o1 = b1[i], o2 = b2[i];
    if (p > t) {  // shift the bins down, dropping what falls off the last
      const int by = p - t < 3 ? p - t : 3;
      o2 = by == 1 ? o1 : by == 2 ? o0 : 0.0;
      o1 = by == 1 ? o0 : 0.0;
      o0 = 0.0;
      t = p;
      top[i] = static_cast<int8_t>(p);
    }
    if (((bits >> 52) & 0x7FF) == 0x7FF) {  // inf / NaN: at position 63, into the top bin as they are
      o0 = __dadd_rn(o0, c);
    } else {
      double u = __dmul_rn(c, binned_inverse_grid(t));
      double d = static_cast<double>(static_cast<long long>(u));  // towards zero, exactly (|u| < 2^32)
      o0 = __dadd_rn(o0, d);
      u = __dmul_rn(__dsub_rn(u, d), kRadix);
      d = static_cast<double>(static_cast<long long>(u));
      o1 = __dadd_rn(o1, d);
      u = __dmul_rn(__dsub_rn(u, d), kRadix);
      o2 = __dadd_rn(o2, static_cast<double>(static_cast<long long>(u)));
    }
    b0[i] = o0;
    b1[i] = o1;
    b2[i] = o2;
  }
}

}  // namespace

template <typename T>
cudaError_t launch_mix_forward(MixPair<T> x, MixPair<T> y, T wa, T wb, cudaStream_t stream) {
  const int64_t n = x.rows * x.cols + y.rows * y.cols;
  if (n == 0) return cudaSuccess;
  const bool vec = x.cols % (16 / sizeof(T)) == 0 && aligned16(x.out) && aligned16(x.a) &&
                   (x.b == nullptr || aligned16(x.b));
  return launch_pair_rows<MixRow>(x, y, vec, wa, wb, stream);
}

template <typename T>
cudaError_t launch_mix_backward(MixPairT<T> x, MixPairT<T> y, T wa, T wb, cudaStream_t stream) {
  const int64_t tiles = (x.cols + kTileCols - 1) / kTileCols + (y.cols + kTileCols - 1) / kTileCols;
  if (tiles == 0) return cudaSuccess;
  const bool sums = (x.gb != nullptr && x.b_rows == 1) || (y.gb != nullptr && y.b_rows == 1);
  if (!sums) {  // the common case (the means need no gradient): elementwise rows, vectorised
    const bool vec = x.cols % (16 / sizeof(T)) == 0 && aligned16(x.g) && (x.ga == nullptr || aligned16(x.ga)) &&
                     (x.gb == nullptr || aligned16(x.gb));
    return launch_pair_rows<ScaleRow>(x, y, vec, wa, wb, stream);
  }
  // a broadcast mean's gradient sums over rows: column tiles in a fixed order (deterministic)
  const dim3 grid(static_cast<unsigned>(blocks_for(tiles, 1, max_blocks())));
  FEDHPC_LAUNCH(grid, dim3(kTileCols, kRowLanes), stream, mix_backward_kernel<T>)(x, y, wa, wb);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_l3_forward(const T* g, const T* xbar, T* s, int64_t rows, int64_t cols, int64_t x_rows, T lam,
                              cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(blocks_for(rows, 1, max_blocks())));
  FEDHPC_LAUNCH(grid, kThreads, stream, l3_forward_kernel<T>)(g, xbar, s, rows, cols, x_rows, lam);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_l3_backward(const T* go, const T* g, const T* xbar, T* gg, T* gx, int64_t rows, int64_t cols,
                               int64_t x_rows, T lam, cudaStream_t stream) {
  const int64_t tiles = (cols + kTileCols - 1) / kTileCols;
  if (tiles == 0) return cudaSuccess;  // rows == 0 still runs: a broadcast mean's gradient is then 0
  if (rows > 0 && (gx == nullptr || x_rows != 1)) {  // no column sum: elementwise rows, vectorised
    constexpr int V = 16 / sizeof(T);
    const bool vec = cols % V == 0 && aligned16(g) && aligned16(xbar) && (gg == nullptr || aligned16(gg)) &&
                     (gx == nullptr || aligned16(gx));
    const dim3 grid = rows_grid(rows, vec ? cols / V : cols, kThreads);
    if (vec) {
      FEDHPC_LAUNCH(grid, kThreads, stream, l3_backward_rows_kernel<T, V>)(go, g, xbar, gg, gx, rows, cols, x_rows,
                                                                          lam);
    } else {
      FEDHPC_LAUNCH(grid, kThreads, stream, l3_backward_rows_kernel<T, 1>)(go, g, xbar, gg, gx, rows, cols, x_rows,
                                                                          lam);
    }
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>(blocks_for(tiles, 1, max_blocks())));
  FEDHPC_LAUNCH(grid, dim3(kTileCols, kRowLanes), stream, l3_backward_kernel<T>)(go, g, xbar, gg, gx, rows, cols,
                                                                                x_rows, lam);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_segment_mix(const T* a, int64_t a_rs, const T* b, int64_t b_rs, T* out, int64_t o_rs,
                               const int64_t* off, int64_t nseg, const T* lam, int64_t lam_rows, int64_t rows,
                               int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  constexpr int V = 16 / sizeof(T);
  const bool vec = cols % V == 0 && a_rs % V == 0 && b_rs % V == 0 && o_rs % V == 0 && aligned16(a) &&
                   aligned16(b) && aligned16(out);
  const bool shared_b = b_rs == 0 && rows > 1;
  const int64_t vecs = vec ? cols / V : cols, per_block = static_cast<int64_t>(kThreads) * kItems;
  const int64_t resident = resident_blocks();
  // Without a shared b every row is its own group. With one, a group's rows share each b vector
  // read: one group (b read once) as long as a row's vectors alone fill the grid the GPU is
  // sized for, else as many groups as fill it, each re-reading b (mostly from L2). On an H100
  // one group at 16 clients x 1M was a 256-block grid at 0.77 of copy bandwidth, where the
  // ~1024-block grids of larger states reached 0.88-0.91.
  int64_t group_rows = 1;
  if (shared_b) {
    const int64_t row_blocks = blocks_for(vecs, per_block, resident);
    const int64_t groups = blocks_for(resident / row_blocks, 1, rows);
    group_rows = (rows + groups - 1) / groups;
  }
  const dim3 grid = rows_grid((rows + group_rows - 1) / group_rows, vecs, per_block, resident);
#define FEDHPC_SEGMENT_LAUNCH(VW, SB)                                                                         \
  FEDHPC_LAUNCH(grid, kThreads, stream, segment_mix_rows_kernel<T, VW, SB>)(a, a_rs, b, b_rs, out, o_rs, off, \
                                                                           nseg, lam, lam_rows, rows, cols,  \
                                                                           group_rows)
  if (vec && shared_b) {
    FEDHPC_SEGMENT_LAUNCH(V, true);
  } else if (vec) {
    FEDHPC_SEGMENT_LAUNCH(V, false);
  } else if (shared_b) {
    FEDHPC_SEGMENT_LAUNCH(1, true);
  } else {
    FEDHPC_SEGMENT_LAUNCH(1, false);
  }
#undef FEDHPC_SEGMENT_LAUNCH
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_binned_add(const T* terms, double alpha, double* bins, int64_t bin_stride, int8_t* top, int64_t n,
                              int p_min, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(blocks_for(n, kThreads, resident_blocks())));
  FEDHPC_LAUNCH(grid, kThreads, stream, binned_add_kernel<T>)(terms, alpha, bins, bins + bin_stride,
                                                              bins + 2 * bin_stride, top, n, p_min);
  return cudaGetLastError();
}

#define FEDHPC_INSTANTIATE(T)                                                                                     \
  template cudaError_t launch_mix_forward<T>(MixPair<T>, MixPair<T>, T, T, cudaStream_t);                        \
  template cudaError_t launch_mix_backward<T>(MixPairT<T>, MixPairT<T>, T, T, cudaStream_t);                     \
  template cudaError_t launch_l3_forward<T>(const T*, const T*, T*, int64_t, int64_t, int64_t, T, cudaStream_t); \
  template cudaError_t launch_l3_backward<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t, int64_t, T, \
                                             cudaStream_t);                                                      \
  template cudaError_t launch_segment_mix<T>(const T*, int64_t, const T*, int64_t, T*, int64_t, const int64_t*,  \
                                             int64_t, const T*, int64_t, int64_t, int64_t, cudaStream_t);  \
  template cudaError_t launch_binned_add<T>(const T*, double, double*, int64_t, int8_t*, int64_t, int, cudaStream_t);
FEDHPC_INSTANTIATE(float)
FEDHPC_INSTANTIATE(double)
#undef FEDHPC_INSTANTIATE

}  // namespace cuda
}  // namespace fedhpc
