"""Where the native sources are and how they are compiled: one rule for setup.py, the JIT and the tests.

Standard library only: setup.py loads this file by path, before fedhpc (or even torch) is importable.
"""

from __future__ import annotations

import hashlib
import os
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(REPO, "csrc")
EXT_NAME = "fedhpc.ops._ext"        # the module `pip install -e .` builds next to this file
JIT_NAME = "fedhpc_ops_ext"         # the module torch.utils.cpp_extension.load builds under build/
ENV_DISABLE = "FEDHPC_NO_EXT"       # 1: no build at install time, no extension at run time
ENV_NO_JIT = "FEDHPC_NO_JIT"        # 1: never compile at run time (prebuilt or pure PyTorch only)
ENV_NO_SIMD = "FEDHPC_NO_SIMD"      # 1: CPU kernels keep their baseline loops (read by csrc/fedhpc_ops.h)

CPU_SOURCES = ["ops.cpp", "autograd.cpp", "cpu/mix_cpu.cpp", "cpu/binned_cpu.cpp"]
CUDA_SOURCES = ["cuda/ops_cuda.cpp", "cuda/mix_kernels.cu"]
HEADERS = ["fedhpc_ops.h", "cuda/mix_kernels.cuh"]

# -ffp-contract=off: no a*b + c*d -> FMA, so elementwise results stay bit-identical to PyTorch's
# separate kernels whatever -march a user adds. No -march=native: a build on a login node must
# run on every compute node.
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers; without the flag the
# compiler drops it and every kernel runs on one thread (it did: 2 threads gained nothing).
# Tuples, and every caller passes a fresh list: torch.utils.cpp_extension appends to the flag
# lists it is given (a CUDA JIT build added CUDA libraries to LD_FLAGS in place, which changed
# sources_hash() in the same process and made the freshly built module look stale).
CXX_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
LD_FLAGS = ("-fopenmp",)
NVCC_FLAGS = ("-O3", "-std=c++17")


def env_flag(name: str) -> bool:
    """True when the environment variable is set to anything but '', 0, false, no or off."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def paths(rel: List[str]) -> List[str]:
    return [os.path.join(CSRC, r) for r in rel]


def sources_hash() -> str:
    """SHA-256 (16 hex digits) of the compiler flags and every native source and header.

    Baked into the built module (-DFEDHPC_SOURCES_HASH) so the loader can tell a prebuilt
    extension made from older sources and rebuild instead of running stale kernels.
    """
    h = hashlib.sha256()
    # the flags too: a module built with other flags (e.g. without OpenMP) is stale as well
    h.update(" ".join(CXX_FLAGS + LD_FLAGS + NVCC_FLAGS).encode() + b"\0")
    for rel in sorted(CPU_SOURCES + CUDA_SOURCES + HEADERS):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(CSRC, rel), "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()[:16]


def define_hash(value: str) -> str:
    """The -D flag carrying the hash: unquoted hex, stringified in csrc/ops.cpp."""
    return f"-DFEDHPC_SOURCES_HASH={value}"
