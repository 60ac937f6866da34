"""Element-wise sums whose bits do not depend on how the terms are grouped or ordered.

The engine sums the clients' weighted uploads, the server trainer the micro-batches' gradients
and the Hessian analysis its batches' products, first on each rank and then over ranks. A
float64 sum of float32-derived terms almost always rounds back to the same float32 whatever the
grouping, but not always: about once per 2**29 weights and round a float32 result moves by one
ulp between rank counts, and training carries the difference on. Summed here, the terms give
the same float64 on 1, 2 or N ranks, in any order, every time.

The method is binned (indexed) summation after Demmel and Nguyen ("Parallel reproducible
summation", IEEE TC 2015; ReproBLAS). A float64 term with biased exponent e lies at digit
position p = e // 32: below 2**32 units of the grid g(p) = 2**(32 p - 1023). Each element keeps
a top position (the highest p of its terms so far) and, in three float64 bins, the sums of its
terms' base-2**32 digits at positions top, top-1 and top-2, each digit cut towards zero, so a
term's digit at a position is a property of the term alone. The bins hold integers below
2**53 while fewer than 2**21 terms arrive, so they add exactly. When a larger term raises top,
the bins shift down and the lowest is dropped: exactly the digits the larger top would have
dropped from every term. The kept digits, hence the result, depend only on the set of terms:
ranks align their bins to the all-reduced maximum top, after which an ordinary sum all-reduce
of the bins is exact. What is dropped is below 2**-64 of the element's largest term, per term:
finer than a float64 sum's rounding. Infinite and NaN terms go into the top bin as they are,
so they propagate as in a plain sum.

Cost per element: three float64 bins (what the all-reduce carries, three times a plain float64
sum's) and an int8 position; per added tensor one native pass (fedhpc.ops.binned_add_: C++ on
the CPU, four elements at a time where AVX2 is present, about as fast as a plain float64 add
from 1M elements up; one CUDA launch on a GPU), about fifteen element-wise operations where no
extension is built; and one extra all-reduce, of the int8 positions.
"""

from __future__ import annotations

from typing import Optional

import torch

from .ops import binned_add_
from .ops.reference import BINNED_BINS as BINS
from .ops.reference import BINNED_P_MIN as P_MIN
from .ops.reference import binned_raise_top_

#: bits per digit (a power of two: the digit position is the exponent field shifted right)
W = 32
#: most terms one element may receive (over all ranks) with every bin sum still exact
MAX_TERMS = 2 ** (53 - W) - 1


def storage_numel(numel: int) -> int:
    """float64 words a :class:`ReproducibleSum` of ``numel`` elements reduces (its ``data``)."""
    return BINS * numel


def _grid(position: torch.Tensor) -> torch.Tensor:
    """g(p) = 2**(32 p - 1023), exactly, from the bits (p within [1, 63])."""
    return (position.to(torch.int64) << 57).view(torch.float64)


class ReproducibleSum:
    """``numel`` running sums of float64 terms with grouping- and order-independent results.

    ``data`` (the bins) is what ranks sum-all-reduce, after :meth:`align_`; callers may hand
    in ``out``, a float64 view of a larger buffer, to reduce it in the same collective as other
    numbers (the engine's round buffer). Use::

        acc.add_(terms, alpha=w, start=k)   # any number of times, on any rank
        acc.align_(world)                   # collective: every rank, same point
        world.all_reduce_sum_(acc.data)     # or a buffer that contains it
        total = acc.sum()
    """

    def __init__(self, numel: int, max_terms: int, device=None, out: Optional[torch.Tensor] = None):
        if not 1 <= max_terms <= MAX_TERMS:
            raise ValueError(f"a reproducible sum takes at most {MAX_TERMS} terms per element "
                             f"(its bins would round beyond that); asked for {max_terms}")
        self.numel = numel
        if out is None:
            out = torch.zeros(storage_numel(numel), dtype=torch.float64, device=device)
        if out.dtype != torch.float64 or out.numel() != storage_numel(numel) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float64 tensor of {storage_numel(numel)} elements")
        self.data = out
        self.bins = out.view(BINS, numel)  # integers: digit sums in units of g(top - k)
        self.top = torch.full((numel,), P_MIN, dtype=torch.int8, device=out.device)

    def zero_(self) -> "ReproducibleSum":
        self.data.zero_()
        self.top.fill_(P_MIN)
        return self

    def add_(self, terms: torch.Tensor, alpha: float = 1.0, start: int = 0) -> "ReproducibleSum":
        """Add ``alpha * terms`` (flattened; the product rounded once, in float64) to elements
        ``start`` .. ``start + terms.numel() - 1``. One native pass on the CPU
        (:func:`fedhpc.ops.binned_add_`), its pure-PyTorch definition elsewhere."""
        end = start + terms.numel()
        if start < 0 or end > self.numel:
            raise ValueError(f"terms for elements {start}..{end - 1} of a sum of {self.numel}")
        binned_add_(terms, alpha, self.bins, self.top, start)
        return self

    def align_(self, world) -> "ReproducibleSum":
        """Bring every rank's bins to the all-reduced top positions (a collective): then an
        ordinary sum all-reduce of ``data`` adds like digits to like, exactly."""
        if world.size > 1:
            top = self.top.clone()
            world.all_reduce_max_(top)
            binned_raise_top_(self.bins, self.top, top)
        return self

    def sum(self) -> torch.Tensor:
        """The sums, float64: each bin scaled to its grid (exactly), added finest first."""
        grid = _grid(self.top - (BINS - 1))
        total = self.bins[BINS - 1] * grid
        for k in range(BINS - 2, -1, -1):
            # the next grid up, exactly (powers of two within float64's normal range); each
            # product is exact (an integer below 2**53 times a power of two), so addcmul's one
            # rounding is the sum's, fused or not
            grid.mul_(2.0 ** W)
            total.addcmul_(self.bins[k], grid)
        return total
