"""Native ops: fused FedMix mixing and l3 reduction, batched layer-wise mixup of flat states.

Ops (each equal to its pure-PyTorch reference in :mod:`fedhpc.ops.reference`):

* :func:`mix_inputs_labels` FedMix's x' = (1-l) x (NaiveMix's (1-l) x + l xbar) and the mixed
  soft label (1-l) y + l ybar, one fused pass each way;
* :func:`fedmix_l3` the per-sample l3 = l <dL/dx', xbar> of FedMix Eq. 5 and its backward,
  differentiable to any order (what FedMix's double backward needs);
* :func:`segment_mix` out = l_seg a + (1 - l_seg) b over flat model states, one coefficient per
  layer segment, a batch of clients at once, in place if asked (pMixFed's broadcast/aggregation);
* :func:`binned_add_` the deposit of :class:`fedhpc.reproducible_sum.ReproducibleSum` (the
  engine's rank-independent sums), bit-identical to its reference: one pass (one launch)
  where the reference makes about fifteen.

Backends. C++ kernels (at::parallel_for, vectorisable loops) and CUDA kernels (one launch per
call) live in ``csrc/``. ``pip install -e .`` builds them when a compiler is present (the CUDA
part when torch has CUDA); otherwise the first op call compiles them once with
``torch.utils.cpp_extension.load`` into ``build/``; if neither works, the pure-PyTorch
reference runs, giving the same numbers (elementwise outputs bit-identical, reductions equal
up to summation order). ``python -m fedhpc.ops`` reports which backend each op uses.

Environment:
  FEDHPC_NO_EXT=1   build nothing at install time and use no extension at run time
  FEDHPC_NO_JIT=1   never compile at run time (a prebuilt extension is still used)
  FEDHPC_NO_SIMD=1  the CPU kernels keep their baseline loops instead of the AVX / AVX2 ones
                    the processor offers (same bits; for tests and for ruling them out)

Native kernels cover float32 and float64 on CPU and CUDA; other dtypes and devices, and
``segment_mix`` calls that need a gradient, run the reference.
"""

from __future__ import annotations

from typing import Dict

from ._loader import native, prefer
from .binned import binned_add_
from .fedmix import fedmix_l3, mix_inputs_labels
from .segment import segment_mix, segment_offsets

OPS = ("mix_inputs_labels", "fedmix_l3", "segment_mix", "binned_add")

__all__ = ["mix_inputs_labels", "fedmix_l3", "segment_mix", "segment_offsets", "binned_add_", "backends", "native",
           "prefer", "OPS"]


def backends() -> Dict[str, Dict[str, str]]:
    """op -> {"cpu": backend, "cuda": backend} for float32/float64 tensors in this process.

    A backend is "native (prebuilt)", "native (jit)" or "torch". Resolving it may run the
    one-time JIT build (see the module docstring).
    """
    nat = native()
    cpu = f"native ({nat.origin})" if nat.module is not None else "torch"
    cuda = cpu if nat.module is not None and nat.with_cuda else "torch"
    return {op: {"cpu": cpu, "cuda": cuda} for op in OPS}
