// csrc/cuda/ops_cuda.cpp against the emulated CUDA runtime and c10/cuda headers of include/.
// The emulated GPU's memory is the host's: tensors on the CPU are its device tensors, so
// is_cuda() reads is_cpu() in the file below (after every header, which the macro must not touch).
#include "fedhpc_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#define is_cuda is_cpu
#include "cuda/ops_cuda.cpp"
