// What the emulation must do for tests/test_ops.py's "cuda-emulated" runs to mean anything,
// checked on small kernels: barriers order shared-memory traffic, a launch covers its whole
// grid once, bad launches and divergent barriers are errors, intrinsics round once.
// Built and run by tests/test_ops.py::test_the_cuda_emulation_itself; prints "ok" or exits 1.
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::printf("failed: %s (line %d)\n", #cond, __LINE__);        \
      return 1;                                                       \
    }                                                                 \
  } while (0)

// Block-wide tree sum in shared memory: right only if every barrier holds. Without the one
// inside the loop (Barrier false) it races, and the shuffled thread order must expose that.
template <bool Barrier>
__global__ void block_sums(const int* in, int* out, int n) {
  __shared__ int red[256];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  red[threadIdx.x] = i < n ? in[i] : 0;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < static_cast<unsigned>(half)) red[threadIdx.x] += red[threadIdx.x + half];
    if (Barrier) __syncthreads();
  }
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = red[0];
}

// Each (block, thread) of a 3-D grid of 2-D blocks marks its global index.
__global__ void mark(int* hits) {
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned t = threadIdx.x + blockDim.x * threadIdx.y;
  hits[b * blockDim.x * blockDim.y + t] += 1;
}

__global__ void divergent(int* out) {
  if (threadIdx.x % 2 == 0) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void rounding(const float* a, float* out) { out[0] = __fadd_rn(__fmul_rn(a[0], a[1]), a[2]); }

int main() {
  const int n = 1000;
  std::vector<int> in(n), out(4, -1);
  long want = 0;
  for (int i = 0; i < n; ++i) want += in[i] = (i * 7919) % 1000 - 300;
  FEDHPC_LAUNCH(dim3(4), dim3(256), nullptr, block_sums<true>)(in.data(), out.data(), n);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(long(out[0]) + out[1] + out[2] + out[3] == want);
  // Thread orders are drawn from a fixed seed (the same in every launch, so a test that passes
  // once passes always): this one exposes the missing barrier.
  FEDHPC_LAUNCH(dim3(4), dim3(256), nullptr, block_sums<false>)(in.data(), out.data(), n);
  CHECK(long(out[0]) + out[1] + out[2] + out[3] != want);

  const dim3 grid(3, 2, 2), block(8, 4);
  std::vector<int> hits(3 * 2 * 2 * 8 * 4, 0);
  FEDHPC_LAUNCH(grid, block, nullptr, mark)(hits.data());
  CHECK(cudaGetLastError() == cudaSuccess);
  for (const int h : hits) CHECK(h == 1);

  FEDHPC_LAUNCH(dim3(1), dim3(2048), nullptr, mark)(hits.data());  // over 1024 threads
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  CHECK(cudaGetLastError() == cudaSuccess);  // reading the error clears it
  FEDHPC_LAUNCH(dim3(1, 65536), dim3(1), nullptr, mark)(hits.data());  // grid.y over 65535
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  FEDHPC_LAUNCH(dim3(0), dim3(32), nullptr, mark)(hits.data());
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  for (const int h : hits) CHECK(h == 1);  // none of them ran

  std::vector<int> sink(64);
  FEDHPC_LAUNCH(dim3(1), dim3(64), nullptr, divergent)(sink.data());
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);

  // 1 + 2^-23 squared is 1 + 2^-22 + 2^-46: rounded once to float it is 1 + 2^-22, and minus
  // (1 + 2^-22) gives 0; a fused multiply-add would keep the 2^-46.
  const float a[3] = {1.0f + 0x1p-23f, 1.0f + 0x1p-23f, -(1.0f + 0x1p-22f)};
  float r = -1;
  FEDHPC_LAUNCH(dim3(1), dim3(1), nullptr, rounding)(a, &r);
  CHECK(r == 0.0f);
  std::printf("ok\n");
  return 0;
}
