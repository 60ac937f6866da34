// Emulated CUDA (see ../../cuda_runtime.h): kernels run when launched, on one default stream.
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime.h>

namespace c10 {
namespace cuda {
struct CUDAStream {
  cudaStream_t stream() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream(c10::DeviceIndex = -1) { return {}; }
}  // namespace cuda
}  // namespace c10
