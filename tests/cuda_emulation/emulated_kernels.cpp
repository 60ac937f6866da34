// csrc/cuda/mix_kernels.cu compiled by the host compiler against the emulation in
// include/cuda_runtime.h (found first on the include path): the kernels run on the CPU.
#include "cuda/mix_kernels.cu"

// Kernels launched so far in this process: the tests check that every op is one launch.
extern "C" long fedhpc_emu_launches() { return fedhpc_emu::launches; }
