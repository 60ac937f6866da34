// csrc/ops.cpp built with FEDHPC_WITH_CUDA, where the emulated GPU is the CPU: every op on CPU
// tensors takes ops.cpp's CUDA branch and runs the emulated CUDA kernels, so the whole module
// (checks, autograd, kernels) can stand in for fedhpc.ops's extension in the tests.
#include "fedhpc_ops.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <mutex>
#include <set>

#define is_cuda is_cpu
#include "ops.cpp"
