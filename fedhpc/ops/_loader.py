"""Finds the native extension once per process: prebuilt, else JIT-compiled, else none.

1. ``fedhpc.ops._ext``, built by ``pip install -e .`` (setup.py), used when its ABI version
   matches and it was built from the csrc/ sources now on disk (their hash is baked in);
2. else ``torch.utils.cpp_extension.load`` compiles csrc/ once into
   ``build/jit-torch<version>-py<version>[-cuda]/`` (cold CPU build: about 40 s of compiler
   time, 20-30 s on 2 idle cores; later processes only re-check it, 0.2 s; ranks starting
   together wait on torch's lock while one compiles; a first build says so on stderr, rank 0
   alone, with how long it takes, instead of a silent first round);
3. else nothing: every op runs its pure-PyTorch reference (:mod:`fedhpc.ops.reference`).

``FEDHPC_NO_EXT=1`` skips 1 and 2, ``FEDHPC_NO_JIT=1`` skips 2. A failed JIT build warns once
and falls back; the reasons for each step skipped are kept for ``python -m fedhpc.ops``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Iterator, List, Optional

import torch

from ..errors import ConfigError
from ..io import atomic_write_text
from . import _sources as src

ABI_VERSION = 6          # must equal kAbiVersion in csrc/ops.cpp
NATIVE_DTYPES = (torch.float32, torch.float64)


@dataclass
class Native:
    module: Optional[ModuleType]
    origin: str                      # "prebuilt", "jit" or "none"
    path: str = ""
    with_cuda: bool = False
    seconds: float = 0.0             # time spent finding / building it
    notes: List[str] = field(default_factory=list)   # why earlier steps were skipped


_native: Optional[Native] = None
_lock = threading.Lock()
_preferred = "auto"


def native() -> Native:
    """The extension this process uses (resolved on first call, then cached)."""
    global _native
    if _native is None:
        with _lock:
            if _native is None:
                t0 = time.perf_counter()
                _native = _resolve()
                _native.seconds = time.perf_counter() - t0
    return _native


def _resolve() -> Native:
    notes: List[str] = []
    if src.env_flag(src.ENV_DISABLE):
        return Native(None, "none", notes=[f"{src.ENV_DISABLE} is set"])
    try:
        current = src.sources_hash()
    except OSError:
        current = None  # installed without csrc/: trust a prebuilt module, nothing to JIT
    module, why = _prebuilt(current)
    if module is not None:
        return Native(module, "prebuilt", module.__file__, bool(module.with_cuda), notes=notes)
    notes.append(why)
    if src.env_flag(src.ENV_NO_JIT):
        return Native(None, "none", notes=notes + [f"{src.ENV_NO_JIT} is set: no run-time build"])
    if current is None:
        return Native(None, "none", notes=notes + [f"no sources at {src.CSRC} to build from"])
    module, why = _jit(current)
    if module is not None:
        return Native(module, "jit", module.__file__, bool(module.with_cuda), notes=notes)
    return Native(None, "none", notes=notes + [why])


def _prebuilt(current: Optional[str]):
    try:
        from . import _ext as module  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, f"no prebuilt extension ({str(exc).splitlines()[0]})"
    if getattr(module, "abi_version", None) != ABI_VERSION:
        return None, f"prebuilt extension has ABI {getattr(module, 'abi_version', None)}, this code needs {ABI_VERSION}"
    if current is not None and module.sources_hash != current:
        return None, "prebuilt extension was built from older csrc/ sources (re-run pip install -e .)"
    return module, ""


def _jit(current: str):
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return None, f"no C++ compiler ({compiler}) for a run-time build"
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        return None, "ninja is missing: the run-time build needs it (pip install ninja)"
    with_cuda = torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    tag = f"jit-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}" + ("-cuda" if with_cuda else "")
    build_dir = os.path.join(src.REPO, "build", tag.replace("+", "_"))
    os.makedirs(build_dir, exist_ok=True)
    defines = [src.define_hash(current)] + (["-DFEDHPC_WITH_CUDA"] if with_cuda else [])
    sources = src.paths(src.CPU_SOURCES + (src.CUDA_SOURCES if with_cuda else []))
    failed = os.path.join(build_dir, f"FAILED-{current}")
    if os.path.exists(failed):  # do not pay for (and warn about) the same broken build in every process
        with open(failed) as f:
            why = f.read().strip()
        return None, f"an earlier run-time build of these sources failed ({why}); delete {failed} to retry"
    fresh = not _jit_build_exists(build_dir)
    t0 = time.perf_counter()
    if fresh:
        _say(f"compiling fedhpc's native ops once (about {'5 min' if with_cuda else '1 min'}: "
             f"later runs reuse {build_dir}; "
             f"pip install --no-build-isolation -e . builds them ahead, FEDHPC_NO_JIT=1 runs the pure-PyTorch ops)...")
    try:
        module = cpp_extension.load(src.JIT_NAME, sources, extra_cflags=[*src.CXX_FLAGS, *defines], extra_ldflags=list(src.LD_FLAGS),
                                    extra_cuda_cflags=[*src.NVCC_FLAGS, *defines], build_directory=build_dir,
                                    with_cuda=with_cuda, verbose=False)
    except Exception as exc:  # a broken toolchain must not stop a run: the reference gives the same numbers
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
        first = next((ln for ln in lines if "error:" in ln), lines[-1])[:300]
        atomic_write_text(failed, first + "\n")
        warnings.warn(f"fedhpc.ops: run-time build failed ({first}); using the pure-PyTorch ops "
                      f"(details: python -m fedhpc.ops)", RuntimeWarning, stacklevel=4)
        return None, f"run-time build failed ({first})"
    if fresh:
        _say(f"compiled fedhpc's native ops in {time.perf_counter() - t0:.0f} s")
    if getattr(module, "abi_version", None) != ABI_VERSION:
        return None, "run-time build has the wrong ABI version"
    return module, ""


def _jit_build_exists(build_dir: str) -> bool:
    """Whether ``build_dir`` holds a run-time build (torch then only re-checks it, in well under a
    second; a source changed since makes it compile again, which this does not see)."""
    return os.path.exists(os.path.join(build_dir, f"{src.JIT_NAME}.so"))


def _say(message: str) -> None:
    """A note on stderr from the first rank alone (ranks starting together wait while one compiles)."""
    from ..config.cli import launcher_rank

    if launcher_rank() == 0:
        print(f"fedhpc.ops: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- per-call choice

def for_tensors(*tensors: Optional[torch.Tensor]) -> Optional[ModuleType]:
    """The extension module if it can run an op on these tensors, else None (use the reference).

    Native kernels cover float32 / float64 tensors of one dtype on one CPU or CUDA device.
    Called on every op, so the common case is a few attribute reads (about 1 us).
    """
    if _preferred == "torch":
        return None
    first = tensors[0]
    dtype, device = first.dtype, first.device
    # A plain loop, not all(<generator>): this runs before every FedMix step's ops, and the
    # generator alone was half of its 1.8 us.
    usable = dtype in NATIVE_DTYPES and (first.is_cpu or first.is_cuda)
    for t in tensors:
        if t is not None and (t.dtype != dtype or t.device != device):
            usable = False
            break
    nat = _native if _native is not None else (native() if usable or _preferred == "native" else None)
    if usable and nat.module is not None and (first.is_cpu or nat.with_cuda):
        return nat.module
    if _preferred == "native":
        raise RuntimeError(f"fedhpc.ops: no native kernel for {dtype} on {device} "
                           f"(extension: {native().origin}; {'; '.join(native().notes)})")
    return None


@contextlib.contextmanager
def prefer(backend: str) -> Iterator[None]:
    """Within the block every op runs on ``backend``: 'torch' (the pure-PyTorch reference),
    'native' (the extension; an op it cannot run raises) or 'auto' (the default choice)."""
    global _preferred
    if backend not in ("auto", "torch", "native"):
        raise ConfigError(f"fedhpc.ops backend must be auto, torch or native, got {backend!r}")
    old, _preferred = _preferred, backend
    try:
        yield
    finally:
        _preferred = old
