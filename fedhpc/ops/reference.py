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
