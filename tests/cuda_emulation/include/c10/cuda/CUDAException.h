// Emulated CUDA (see ../../cuda_runtime.h): a failed launch raises, as C10_CUDA_CHECK does.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#define C10_CUDA_CHECK(EXPR)                                                                  \
  do {                                                                                        \
    const cudaError_t fedhpc_emu_error = (EXPR);                                              \
    TORCH_CHECK(fedhpc_emu_error == cudaSuccess, "CUDA error (emulated): ",                   \
                cudaGetErrorString(fedhpc_emu_error));                                        \
  } while (0)
