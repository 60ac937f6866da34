"""The optional native extension fedhpc.ops._ext (csrc/); the package's metadata and
dependencies are in pyproject.toml, which setuptools reads beside this file.

The extension is built when torch and a C++ compiler are there (its CUDA kernels too when torch
has CUDA and nvcc is found), and never stops the install: without a compiler, with
FEDHPC_NO_EXT=1, or when a build fails, the package installs as pure Python and fedhpc.ops
falls back to a run-time (JIT) build or to its pure-PyTorch implementation (same numbers).
`python -m fedhpc.ops` says which one runs. Build with `pip install --no-build-isolation -e .`
so that the build sees the installed CPU torch instead of fetching another.
"""

import importlib.util
import os
import shutil
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_sources():
    """fedhpc/ops/_sources.py (sources, flags, hash) without importing the fedhpc package."""
    spec = importlib.util.spec_from_file_location("_fedhpc_sources", os.path.join(HERE, "fedhpc", "ops", "_sources.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _say(msg):
    print(f"fedhpc setup: {msg}", file=sys.stderr)


def native_extension():
    """(ext_modules, cmdclass) for the extension, or ([], {}) with a message saying why not."""
    src = _load_sources()
    if src.env_flag(src.ENV_DISABLE):
        _say(f"{src.ENV_DISABLE} is set: installing without the native extension")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # noqa: BLE001 - any failure here only means "no extension"
        _say(f"torch is not importable ({exc}): installing without the native extension")
        return [], {}
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        _say(f"no C++ compiler ({compiler}): installing without the native extension "
             "(fedhpc.ops runs its pure-PyTorch implementation)")
        return [], {}
    defines = [src.define_hash(src.sources_hash())]
    cpu_sources = [os.path.relpath(p, HERE) for p in src.paths(src.CPU_SOURCES)]
    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if with_cuda:
        cuda_sources = [os.path.relpath(p, HERE) for p in src.paths(src.CUDA_SOURCES)]
        ext = cpp_extension.CUDAExtension(
            src.EXT_NAME, cpu_sources + cuda_sources,
            extra_compile_args={"cxx": [*src.CXX_FLAGS, *defines, "-DFEDHPC_WITH_CUDA"],
                                "nvcc": [*src.NVCC_FLAGS, *defines, "-DFEDHPC_WITH_CUDA"]},
            extra_link_args=list(src.LD_FLAGS))
    else:
        ext = cpp_extension.CppExtension(src.EXT_NAME, cpu_sources,
                                         extra_compile_args={"cxx": [*src.CXX_FLAGS, *defines]},
                                         extra_link_args=list(src.LD_FLAGS))
    ext.fedhpc_cpu_sources = cpu_sources
    ext.optional = True  # setuptools then skips copying a module that was not built

    class TolerantBuild(cpp_extension.BuildExtension):
        """A failed build is a warning: a CUDA build retries without CUDA, then the install goes on."""

        def finalize_options(self):
            super().finalize_options()
            # pip builds in a fresh temporary folder each time; objects kept under build/ let
            # ninja skip unchanged sources, so re-running scripts/setup_env.sh costs a link, not a build.
            self.build_temp = os.path.join(HERE, "build", f"ext-py{sys.version_info[0]}{sys.version_info[1]}"
                                           f"-torch{torch.__version__.replace('+', '_')}")

        def build_extensions(self):
            # Whole-command level: torch's own checks (e.g. nvcc vs torch CUDA versions) run here,
            # before any single extension is compiled.
            try:
                super().build_extensions()
                _say(f"built {ext.name} ({'CPU + CUDA' if with_cuda else 'CPU'} kernels)")
                return
            except Exception as exc:  # noqa: BLE001
                error = exc
            if with_cuda:
                _say(f"the CUDA build failed ({error}); retrying with the CPU kernels only")
                ext.sources = list(ext.fedhpc_cpu_sources)
                for key, flags in ext.extra_compile_args.items():
                    ext.extra_compile_args[key] = [f for f in flags if f != "-DFEDHPC_WITH_CUDA"]
                try:
                    super().build_extensions()
                    _say(f"built {ext.name} (CPU kernels only)")
                    return
                except Exception as exc:  # noqa: BLE001
                    error = exc
            _say(f"native extension not built ({error}); fedhpc.ops will try a run-time build, "
                 "then its pure-PyTorch implementation")

    return [ext], {"build_ext": TolerantBuild.with_options(no_python_abi_suffix=False)}


ext_modules, cmdclass = native_extension()

setup(ext_modules=ext_modules, cmdclass=cmdclass)
