// A CPU emulation of the part of CUDA that csrc/cuda/mix_kernels.cu uses, so that its kernels
// and the torch-facing binding (cuda/ops_cuda.cpp) run in the tests of a machine without a GPU
// (tests/test_ops.py, device "cuda-emulated"). Nothing in fedhpc includes this file.
//
// Emulated, as CUDA defines it:
// * the execution model: a grid of blocks of threads. The threads of a block run as fibers
//   (ucontext) on the calling OS thread, and __syncthreads() is a barrier between them: each
//   runs until its next barrier, then another, in a shuffled order. A block whose threads
//   reach a different number of barriers is an error (on a GPU it hangs or corrupts memory).
// * blocks run one after another in a shuffled (fixed) order: a kernel may not depend on the
//   order of its blocks, and grid-stride loops really stride (the emulated GPU has
//   FEDHPC_EMU_SMS multiprocessors, 2 by default, so grids sized from it are small, and
//   FEDHPC_EMU_GRID_CAP lowers the launchers' caps on grid sizes, so row and tile loops too);
// * __shared__ variables are per block (static storage: one block runs at a time);
// * launch limits: at most 1024 threads a block, grid y and z at most 65535, no empty
//   dimension; a bad launch sets cudaErrorInvalidConfiguration for cudaGetLastError();
// * the arithmetic intrinsics (__fmul_rn, ...) as single IEEE operations (build with
//   -ffp-contract=off so the compiler does not fuse them either).
// Not emulated: threads running at the same time (a race that no barrier separates shows only
// when the shuffled order happens to expose it), warp-level operations (the kernels use none),
// the memory model, streams and timing. Device memory is host memory.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) double2 {
  double x, y;
};

typedef struct CUstream_st* cudaStream_t;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

// Per OS thread, like the launch that sets them; the scheduler sets threadIdx before resuming a fiber.
inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline long long __double_as_longlong(double d) {
  long long v;
  std::memcpy(&v, &d, sizeof v);
  return v;
}
inline double __longlong_as_double(long long v) {
  double d;
  std::memcpy(&d, &v, sizeof d);
  return d;
}

namespace fedhpc_emu {

inline thread_local cudaError_t last_error = cudaSuccess;
// Kernels launched (valid launches), their blocks and the last one's grid, read by the tests
// (emulated_kernels.cpp).
inline long launches = 0, blocks_run = 0;
inline dim3 last_grid;

inline int multiprocessors() {
  const char* v = std::getenv("FEDHPC_EMU_SMS");
  const int n = v ? std::atoi(v) : 2;
  return n > 0 ? n : 2;
}

// The launchers' grid caps (FEDHPC_GRID_CAP in mix_kernels.cu: 4096 blocks for the reducing
// kernels, CUDA's 65535 for gridDim.y), lowered to FEDHPC_EMU_GRID_CAP when that is set, so
// that small inputs run the grid-stride loops a GPU reaches only past those many rows or tiles.
inline int64_t grid_cap(int64_t limit) {
  const char* v = std::getenv("FEDHPC_EMU_GRID_CAP");
  const long long n = v ? std::atoll(v) : 0;
  return n > 0 && n < limit ? n : limit;
}

// The threads of the block being run, as fibers.
struct Block {
  static constexpr size_t kStack = 64 * 1024;
  ucontext_t scheduler;
  std::vector<ucontext_t> ctx;
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<char> done;
  int current = 0;
  const std::function<void()>* body = nullptr;
  std::mt19937 rng{12345};
};
inline thread_local Block* running = nullptr;

inline void fiber_main() {
  Block& b = *running;
  (*b.body)();
  b.done[b.current] = 1;  // returning resumes uc_link: the scheduler
}

// Runs one block's threads to the end; false when they disagreed on the barriers.
inline bool run_block(Block& b, dim3 block, const std::function<void()>& body) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  b.body = &body;
  b.ctx.resize(n);
  while (static_cast<int>(b.stacks.size()) < n) b.stacks.emplace_back(new char[Block::kStack]);
  b.done.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    getcontext(&b.ctx[i]);
    b.ctx[i].uc_stack.ss_sp = b.stacks[i].get();
    b.ctx[i].uc_stack.ss_size = Block::kStack;
    b.ctx[i].uc_link = &b.scheduler;
    makecontext(&b.ctx[i], fiber_main, 0);
  }
  int live = n;
  bool agreed = true;
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  while (live > 0) {
    // One round: every live thread runs to its next barrier or its end, in a shuffled order (a
    // read of another thread's write that no barrier separates then sees it or not, by chance
    // fixed by the seed, as on a GPU). After the round all live threads wait at the same barrier.
    std::shuffle(order.begin(), order.end(), b.rng);
    int finished = 0;
    for (const int i : order) {
      if (b.done[i]) continue;
      b.current = i;
      threadIdx = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
      swapcontext(&b.scheduler, &b.ctx[i]);
      if (b.done[i]) ++finished;
    }
    live -= finished;
    if (finished > 0 && live > 0) agreed = false;  // some threads left while others wait at a barrier
  }
  return agreed;
}

inline bool valid_launch(dim3 grid, dim3 block) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  return grid.x >= 1 && grid.y >= 1 && grid.z >= 1 && grid.x <= 0x7fffffffu && grid.y <= 65535 &&
         grid.z <= 65535 && block.x >= 1 && block.y >= 1 && block.z >= 1 && block.x <= 1024 && block.y <= 1024 &&
         block.z <= 64 && threads <= 1024;
}

template <typename... P>
struct Launch {
  dim3 grid, block;
  void (*kernel)(P...);

  template <typename... A>
  void operator()(A&&... args) const {
    if (!valid_launch(grid, block)) {
      last_error = cudaErrorInvalidConfiguration;
      return;
    }
    ++launches;
    blocks_run += static_cast<long>(uint64_t(grid.x) * grid.y * grid.z);
    last_grid = grid;
    // A launch copies its arguments, as the GPU's parameter buffer does.
    std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    const std::function<void()> body = [&] { std::apply(kernel, params); };
    const uint64_t nblocks = uint64_t(grid.x) * grid.y * grid.z;
    std::vector<uint64_t> order(nblocks);
    for (uint64_t i = 0; i < nblocks; ++i) order[i] = i;
    std::mt19937_64 rng(nblocks * 0x9e3779b97f4a7c15ull + grid.x);
    std::shuffle(order.begin(), order.end(), rng);
    Block b;
    Block* outer = running;
    running = &b;
    bool agreed = true;
    for (const uint64_t i : order) {
      blockIdx = dim3(i % grid.x, (i / grid.x) % grid.y, i / (uint64_t(grid.x) * grid.y));
      blockDim = block;
      gridDim = grid;
      agreed = run_block(b, block, body) && agreed;
    }
    running = outer;
    if (!agreed) {
      std::fprintf(stderr, "fedhpc CUDA emulation: the threads of a block reached different numbers of "
                           "__syncthreads() barriers\n");
      last_error = cudaErrorLaunchFailure;
    }
  }
};

template <typename... P>
Launch<P...> launch(dim3 grid, dim3 block, void (*kernel)(P...)) {
  return {grid, block, kernel};
}

}  // namespace fedhpc_emu

inline void __syncthreads() {
  fedhpc_emu::Block& b = *fedhpc_emu::running;
  swapcontext(&b.ctx[b.current], &b.scheduler);
}

// mix_kernels.cu launches through FEDHPC_LAUNCH (<<<grid, block, 0, stream>>> under nvcc).
#define FEDHPC_LAUNCH(grid, block, stream, ...) ::fedhpc_emu::launch(grid, block, __VA_ARGS__)
#define FEDHPC_GRID_CAP(limit) ::fedhpc_emu::grid_cap(limit)

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = fedhpc_emu::last_error;
  fedhpc_emu::last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/) {
  *value = attr == cudaDevAttrMultiProcessorCount ? fedhpc_emu::multiprocessors() : 0;
  return cudaSuccess;
}
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}
