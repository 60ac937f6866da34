"""Builds fedhpc's CUDA kernels and their torch binding against a CPU emulation of CUDA.

The extension built here is csrc/ as a CUDA build would compile it (ops.cpp with
FEDHPC_WITH_CUDA, cuda/ops_cuda.cpp, cuda/mix_kernels.cu), except that the host compiler builds
the .cu against ``include/cuda_runtime.h`` (grids of blocks of fiber threads with real
barriers, run on the CPU) and the GPU's memory is host memory: CPU tensors take every CUDA
branch. Swapped in for fedhpc.ops's extension (``emulated_native()``), it lets the tests run
the CUDA code paths on a machine without a GPU. It proves the index arithmetic, the vector and
scalar paths, the grid-stride loops, the reductions' combine order and the binding's shapes;
it cannot prove what only a GPU shows (threads racing, the memory model, speed).
"""

from __future__ import annotations

import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "fedhpc_ops_cuda_emulated"

_module = None
_error = None


def build():
    """The emulated-CUDA extension module (compiled once per csrc/ content, about a minute cold)."""
    global _module, _error
    if _error is not None:
        raise _error
    if _module is not None:
        return _module
    from torch.utils import cpp_extension

    from fedhpc.ops import _sources as src

    build_dir = os.path.join(src.REPO, "build", f"cuda-emulation-torch{torch.__version__}".replace("+", "_"))
    os.makedirs(build_dir, exist_ok=True)
    sources = [os.path.join(HERE, f) for f in ("emulated_ops.cpp", "emulated_ops_cuda.cpp", "emulated_kernels.cpp")]
    sources += src.paths(["autograd.cpp", "cpu/mix_cpu.cpp", "cpu/binned_cpu.cpp"])
    # The csrc/ hash among the flags: torch's JIT versions a module by its listed sources, and
    # these include csrc/ files it does not see.
    flags = ["-O2", "-ffp-contract=off", "-fopenmp", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
             "-DFEDHPC_WITH_CUDA", src.define_hash(src.sources_hash())]
    try:
        _module = cpp_extension.load(NAME, sources, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                     extra_include_paths=[os.path.join(HERE, "include"), src.CSRC],
                                     build_directory=build_dir, verbose=False)
    except Exception as exc:  # reported by the caller as a skip, with the compiler's words
        _error = exc
        raise
    return _module


def _counter(name: str) -> int:
    import ctypes

    fn = getattr(ctypes.CDLL(build().__file__), name)  # the module's own, already loaded library
    fn.restype = ctypes.c_long
    return int(fn())


def launches() -> int:
    """Kernels the emulated extension has launched in this process (valid launches only)."""
    return _counter("fedhpc_emu_launches")


def blocks() -> int:
    """Blocks those launches ran."""
    return _counter("fedhpc_emu_blocks")


def last_grid() -> tuple:
    """(gridDim.x, gridDim.y) of the last launch."""
    return _counter("fedhpc_emu_last_grid_x"), _counter("fedhpc_emu_last_grid_y")


def emulated_native():
    """A fedhpc.ops._loader.Native for the emulated-CUDA module, to put in ``_loader._native``."""
    from fedhpc.ops import _loader

    module = build()
    assert module.with_cuda and module.abi_version == _loader.ABI_VERSION
    return _loader.Native(module, "emulated-cuda", module.__file__, True)
