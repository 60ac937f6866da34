"""The deposit step of :class:`fedhpc.reproducible_sum.ReproducibleSum`, native on the CPU.

Its pure-PyTorch definition (:func:`fedhpc.ops.reference.binned_add_`) is about fifteen
element-wise passes over the terms; the C++ kernel (csrc/cpu/binned_cpu.cpp) is one, with
the same bits. On a GPU the reference runs: its passes cost little next to a client's training.
"""

from __future__ import annotations

from torch import Tensor

from . import _loader, reference


def binned_add_(terms: Tensor, alpha: float, bins: Tensor, top: Tensor, start: int) -> None:
    """Add ``alpha * terms`` to elements ``start`` .. of a binned sum (layout: fedhpc.ops.reference)."""
    terms = terms.reshape(-1)
    ext = None
    if bins.is_cpu and terms.is_cpu and terms.dtype in _loader.NATIVE_DTYPES:
        ext = _loader.for_tensors(bins)
    if ext is None:
        reference.binned_add_(terms, alpha, bins, top, start)
    else:
        ext.binned_add(terms.contiguous(), float(alpha), bins, top, int(start))
