"""One epoch of K clients' batches, padded to (K, S, B, ...): each client's own permutation and
augmentation stream, gathered with one indexing of the group's joined rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ..data.base import host_to_device
from ..round import ClientContext


@dataclass
class EpochBatches:
    """Every client's batches of one epoch, padded to (K, S, B, ...)."""

    x: torch.Tensor        # (K, S, B, ...)
    y: torch.Tensor        # (K, S, B)
    weight: torch.Tensor   # (K, S, B): 1/n_real on real rows, 0 on padding
    real: List[List[int]]  # real[k][s]: real rows of client k at step s (0: masked-out step)
    steps: int
    counts: torch.Tensor   # (K, S) float64: ``real`` as a tensor (for the loss sums)


def _span(parts: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """The one tensor ``parts`` (of one dtype and row shape, at least one row in all) are the rows of,
    in order, as a view, when they lie one after another in one storage; else None."""
    parts = [p for p in parts if p.shape[0] > 0]
    first = parts[0]
    if len(parts) == 1:
        return first
    if all(p.is_contiguous() for p in parts) and len({p.untyped_storage().data_ptr() for p in parts}) == 1 \
            and all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(parts, parts[1:])):
        rows = sum(p.shape[0] for p in parts)
        return first.as_strided((rows,) + tuple(first.shape[1:]), first.stride(), first.storage_offset())
    return None


def _joined(parts: List[torch.Tensor]) -> torch.Tensor:
    """``parts`` as one tensor along rows: read in place when they lie one after another in one storage
    (a group's training rows moved together: ClientData.all_training_on), else a copy."""
    span = _span(parts)
    return span if span is not None else torch.cat(parts)


def epoch_batches(ctxs: List[ClientContext], epoch: int, batch_size: int) -> Optional[EpochBatches]:
    """The clients' own batches of ``epoch`` (ClientContext.batches: same order, same augmentation).

    A client's batches are consecutive chunks of its permutation, so rows [s*B, s*B + n_s) of its
    padded row hold batch s and only the last batch can be short. Without augmentation the group's
    epoch is one gather: the clients' training rows joined and transformed (row-wise then), a zero
    row after them, and one index of (K, S*B) positions, each client's permutation and then the zero
    row for its padding (a few kernels a group; batch by batch took a few a step and client). With
    augmentation the batches come from ``ctx.batches``, whose generator draws batch by batch."""
    k = len(ctxs)
    sizes = [ctx.num_train for ctx in ctxs]
    steps = max(-(-n // batch_size) for n in sizes)
    if steps == 0:
        return None  # no client of the group has training data: nothing to step
    width = steps * batch_size
    real: List[List[int]] = []
    weights: List[List[float]] = []
    for n in sizes:
        counts = [min(batch_size, n - s) for s in range(0, n, batch_size)]
        real.append(counts + [0] * (steps - len(counts)))
        row: List[float] = []
        for c in real[-1]:  # 1/c on a step's c real rows, 0 on its padding
            row += [1.0 / c] * c + [0.0] * (batch_size - c) if c else [0.0] * batch_size
        weights.append(row)
    transform = ctxs[0].algo.data.transform
    if ctxs[0].algo.data.augments:
        x = y = None
        for i, ctx in enumerate(ctxs):
            if sizes[i] == 0:
                continue
            batches = list(ctx.batches(epoch, batch_size))
            bx, by = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            if x is None:
                x = torch.zeros((k, width) + tuple(bx.shape[1:]), dtype=bx.dtype, device=bx.device)
                y = torch.zeros((k, width), dtype=torch.long, device=bx.device)
            x[i, :sizes[i]] = bx
            y[i, :sizes[i]] = by
    else:
        xs = transform(_joined([ctx.data.x for ctx in ctxs]), True, None)
        ys = _joined([ctx.data.y for ctx in ctxs])
        index = torch.full((k, width), sum(sizes), dtype=torch.long)  # the zero row, for padding
        start = 0
        for i, ctx in enumerate(ctxs):
            index[i, :sizes[i]] = ctx.permutation(epoch) + start
            start += sizes[i]
        index = host_to_device(index, xs.device)  # one copy for the group
        x = torch.cat([xs, xs.new_zeros((1,) + tuple(xs.shape[1:]))])[index]
        y = torch.cat([ys, ys.new_zeros(1)])[index].to(torch.long)
    weight = host_to_device(torch.tensor(weights, dtype=x.dtype if x.is_floating_point() else torch.float32),
                            x.device).view(k, steps, batch_size)
    shape = (k, steps, batch_size)
    counts = host_to_device(torch.tensor(real, dtype=torch.float64), x.device)
    return EpochBatches(x.view(shape + tuple(x.shape[2:])), y.view(shape), weight, real, steps, counts)
