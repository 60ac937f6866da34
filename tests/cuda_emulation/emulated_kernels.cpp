// csrc/cuda/mix_kernels.cu compiled by the host compiler against the emulation in
// include/cuda_runtime.h (found first on the include path): the kernels run on the CPU.
#include "cuda/mix_kernels.cu"

// Kernels launched so far in this process, their blocks and the last launch's grid: the tests
// check that every op is one launch, that grids really change with the emulated GPU's size,
// and how segment_mix shapes its grid.
extern "C" long fedhpc_emu_launches() { return fedhpc_emu::launches; }
extern "C" long fedhpc_emu_blocks() { return fedhpc_emu::blocks_run; }
extern "C" long fedhpc_emu_last_grid_x() { return fedhpc_emu::last_grid.x; }
extern "C" long fedhpc_emu_last_grid_y() { return fedhpc_emu::last_grid.y; }
