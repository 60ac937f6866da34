// csrc/cuda/mix_kernels.cu compiled by the host compiler against the emulation in
// include/cuda_runtime.h (found first on the include path): the kernels run on the CPU.
#include "cuda/mix_kernels.cu"

// Kernels launched so far in this process, and their blocks: the tests check that every op is
// one launch, and that grids really change with the emulated GPU's size.
extern "C" long fedhpc_emu_launches() { return fedhpc_emu::launches; }
extern "C" long fedhpc_emu_blocks() { return fedhpc_emu::blocks_run; }
