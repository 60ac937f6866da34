"""Pure-PyTorch definitions of the native ops: what runs without the extension, and what the
kernels must equal (tests/test_ops.py). Each is a handful of vectorised tensor operations;
autograd differentiates them to any order.

The arithmetic order here is the contract the kernels follow: products are rounded before
they are added, the broadcast mean's gradient is summed over the batch before it is scaled
(mixing), and scaled before it is summed (l3), as autograd does for these expressions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def mix_inputs_labels(x: torch.Tensor, y: torch.Tensor, ybar: torch.Tensor, lam: float,
                      xbar: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """x~ = (1-l) x [+ l xbar],  y~ = (1-l) y + l ybar  (means broadcast over the batch if they have one row)."""
    xm = (1 - lam) * x if xbar is None else (1 - lam) * x + lam * xbar
    return xm, (1 - lam) * y + lam * ybar


def fedmix_l3(g: torch.Tensor, xbar: torch.Tensor, lam: float) -> torch.Tensor:
    """Per-sample l3 of FedMix Eq. 5: s_i = l <g_i, xbar_i> over all non-batch dimensions, shape (B,)."""
    prod = g * xbar
    return lam * (prod.flatten(1).sum(1) if prod.dim() > 1 else prod)


def segment_mix(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, lam: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out = l_seg * a + (1 - l_seg) * b with one coefficient per segment (and per client).

    One vectorised expression over the flat state: the (S,) or (C, S) coefficients are
    repeated over the segment lengths into (P,) or (C, P), then broadcast against a and b.
    """
    lengths = (offsets[1:] - offsets[:-1]).to(lam.device)
    lam_e = torch.repeat_interleave(lam.to(a.dtype), lengths, dim=-1, output_size=a.shape[-1])
    first, second = lam_e * a, (1 - lam_e) * b
    if out is None:
        return first + second
    return torch.add(first, second, out=out)


# --------------------------------------------------------------------------- binned sums
# fedhpc.reproducible_sum's layout: (BINS, N) float64 bins of digit sums and an int8 top
# position per element. Digit positions, grids and why each step is exact: that module's
# docstring.

BINNED_BINS = 3       # csrc: kBinnedBins
BINNED_P_MIN = 3      # lowest top position: the finest grid g(1) = 2**-991 stays a normal double
_RADIX = 2.0 ** 32    # one digit


def binned_inverse_grid(position: torch.Tensor) -> torch.Tensor:
    """1 / g(p) = 2**(1023 - 32 p), exactly, from the bits."""
    return ((2046 << 52) - (position.to(torch.int64) << 57)).view(torch.float64)


def binned_raise_top_(bins: torch.Tensor, top: torch.Tensor, new_top: torch.Tensor) -> None:
    """Move elements to top positions ``new_top`` (>= ``top``): their bins shift down by the
    difference, what falls off the last bin is dropped; ``top`` follows."""
    rows = torch.arange(BINNED_BINS, dtype=torch.int64, device=bins.device).unsqueeze(1)
    by = (new_top.to(torch.int64) - top.to(torch.int64)).clamp_(max=BINNED_BINS)
    source = rows - by.unsqueeze(0)                      # new bin k <- old bin k - by
    source = torch.where(source < 0, BINNED_BINS, source)  # row BINNED_BINS: zeros
    padded = torch.cat([bins, bins.new_zeros(1, bins.shape[1])])
    bins.copy_(padded.gather(0, source))
    top.copy_(new_top)


def binned_add_(terms: torch.Tensor, alpha: float, bins: torch.Tensor, top: torch.Tensor, start: int) -> None:
    """Add ``alpha * terms`` (1-D; the product rounded once, in float64) to elements ``start`` ..
    of ``bins`` (BINNED_BINS, N) with positions ``top`` (N,) int8."""
    c = terms.to(torch.float64)
    if alpha != 1.0:
        c = c * alpha
    where = slice(start, start + c.numel())
    bins, top = bins[:, where], top[where]
    # a float64's exponent field >> 5; inf and NaN (all ones) land at 63, above every finite term
    position = ((c.view(torch.int64) >> 57) & 63).clamp_(min=BINNED_P_MIN)
    nonfinite = None
    if not bool(torch.isfinite(c).all()):
        nonfinite = ~torch.isfinite(c)
        special, c = c, torch.where(nonfinite, 0.0, c)
    if bool((position > top).any()):
        binned_raise_top_(bins, top, torch.maximum(top, position))
    # the digits at top, top-1, top-2, cut towards zero: u - trunc(u) is exact, and so is every
    # scaling by a power of two
    u = c * binned_inverse_grid(top)
    for k in range(BINNED_BINS):
        digit = torch.trunc(u)
        bins[k] += digit if k or nonfinite is None else torch.where(nonfinite, special, digit)
        if k + 1 < BINNED_BINS:
            u.sub_(digit).mul_(_RADIX)
