// Emulated CUDA (see ../../cuda_runtime.h): one device, nothing to switch to.
#pragma once

#include <c10/core/Device.h>

namespace c10 {
namespace cuda {
struct CUDAGuard {
  explicit CUDAGuard(c10::Device) {}
};
}  // namespace cuda
}  // namespace c10
