"""The deposit step of :class:`fedhpc.reproducible_sum.ReproducibleSum`, native on CPU and GPU.

Its pure-PyTorch definition (:func:`fedhpc.ops.reference.binned_add_`) is about fifteen
element-wise passes over the terms, with temporaries the size of the model; the C++ kernel
(csrc/cpu/binned_cpu.cpp) is one pass and the CUDA kernel (csrc/cuda/mix_kernels.cu) one
launch, with the same bits.
"""

from __future__ import annotations

from torch import Tensor

from . import _loader, reference


def binned_add_(terms: Tensor, alpha: float, bins: Tensor, top: Tensor, start: int) -> None:
    """Add ``alpha * terms`` to elements ``start`` .. of a binned sum (layout: fedhpc.ops.reference)."""
    terms = terms.reshape(-1)
    ext = None
    if terms.device == bins.device and terms.dtype in _loader.NATIVE_DTYPES:
        ext = _loader.for_tensors(bins)  # float64, so by the bins alone (terms may be float32)
    if ext is None:
        reference.binned_add_(terms, alpha, bins, top, start)
    else:
        ext.binned_add(terms.contiguous(), float(alpha), bins, top, int(start))
