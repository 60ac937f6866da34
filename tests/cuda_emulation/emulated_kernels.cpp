// csrc/cuda/mix_kernels.cu compiled by the host compiler against the emulation in
// include/cuda_runtime.h (found first on the include path): the kernels run on the CPU.
#include "cuda/mix_kernels.cu"
