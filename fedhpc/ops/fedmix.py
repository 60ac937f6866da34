"""The FedMix ops (FedMix paper, Alg. 2 / Eq. 5).

With x' = (1-l) x the loss is l1 + l2 + l3, where l1 + l2 = L(f(x'), (1-l) y + l ybar) because
soft cross-entropy is linear in its target, and l3 = l <dL/dx', xbar>. Two ops cover the
elementwise work around the model:

* :func:`mix_inputs_labels`: x' (or NaiveMix's (1-l) x + l xbar) and the mixed soft label,
  one fused pass forward and one backward (its transpose);
* :func:`fedmix_l3`: the per-sample reduction s_i = l <g_i, xbar_i> of the input gradient
  g = dL/dx' against the received mean (one per batch, broadcast, or one per sample), one
  pass forward and one backward, without the B x D product autograd would keep.

Second order. FedMix differentiates l3 with respect to the weights through g, which the caller
builds with ``create_graph=True``; that needs only the first derivative of these ops, which
autograd then chains into the model's double backward. The native ops are C++ autograd
Functions (csrc/autograd.cpp) whose backwards are again such Functions (mixing is linear, l3
bilinear), so they are differentiable to any order, as ``gradgradcheck`` verifies.

Without the extension, for other dtypes, or under ``fedhpc.ops.prefer('torch')``, the
expressions of :mod:`fedhpc.ops.reference` run instead: elementwise results are bit-identical,
reductions (l3, gradients of a broadcast mean) equal up to summation order.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _loader, reference

Tensor = torch.Tensor


def _check_mean(mean: Tensor, like: Tensor, name: str, like_name: str) -> None:
    if mean.dim() != like.dim() or mean.shape[1:] != like.shape[1:] or mean.shape[0] not in (1, like.shape[0]):
        raise ValueError(f"{name} must have shape (1 or {like.shape[0]}, {', '.join(map(str, like.shape[1:]))}) "
                         f"like {like_name}, got {tuple(mean.shape)}")


def mix_inputs_labels(x: Tensor, y: Tensor, ybar: Tensor, lam: float,
                      xbar: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(1-l) x [+ l xbar] and (1-l) y + l ybar in one fused pass (FedMix's x' and mixed label).

    x (B, ...) and y (B, ...) are the local inputs (in mixing space) and soft labels; ybar and
    the optional xbar are received means with 1 row (one per batch, broadcast) or B rows (one
    per sample). Without xbar the input is FedMix's x' = (1-l) x; with it, NaiveMix's mixup.
    Differentiable in every tensor argument, to any order.
    """
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"x and y must have the same batch size, got {x.shape[0]} and {y.shape[0]}")
    _check_mean(ybar, y, "ybar", "y")
    if xbar is not None:
        _check_mean(xbar, x, "xbar", "x")
    ext = _loader.for_tensors(x, xbar, y, ybar)
    if ext is None:
        return reference.mix_inputs_labels(x, y, ybar, lam, xbar)
    return ext.mix(x, xbar, y, ybar, float(lam))


def fedmix_l3(g: Tensor, xbar: Tensor, lam: float) -> Tensor:
    """Per-sample l3 of FedMix Eq. 5: s_i = l <g_i, xbar_i>, summed over every non-batch dimension.

    g (B, ...) is dL/dx' (taken with ``create_graph=True`` so that l3 trains the weights);
    xbar has 1 row (one mean per batch, broadcast) or B rows (one per sample). Returns (B,);
    FedMix's l3 is its sum when L is the batch-mean loss (then g_i = (1/B) dL_i/dx'_i).
    Differentiable in g and xbar to any order.
    """
    _check_mean(xbar, g, "xbar", "the input gradient")
    ext = _loader.for_tensors(g, xbar)
    if ext is None:
        return reference.fedmix_l3(g, xbar, lam)
    return ext.l3(g, xbar, float(lam))
