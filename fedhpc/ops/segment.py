"""Layer-wise (segmented) mixup of flat model states, for many clients at once.

pMixFed (Eqs. 5-8) mixes the global model G and each client's local model L block by block,
with one coefficient per layer block: at broadcast L' = l_i G_i + (1 - l_i) L_i, at
aggregation G' = l_i G_i + (1 - l_i) L_i. Over :class:`fedhpc.flat.FlatModel` states a
"layer block" is a contiguous segment of the flat vector, so one call

    out[c, p] = lam[c, s] * a[c, p] + (1 - lam[c, s]) * b[c, p],   offsets[s] <= p < offsets[s+1]

mixes a batch of C client states against one global state (or C of them), every segment and
every client in one pass (one kernel launch on a GPU).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from . import _loader, reference

Tensor = torch.Tensor


def segment_offsets(lengths: Sequence[int]) -> Tensor:
    """Segment boundaries (S+1,) int64 from segment lengths: 0, l0, l0+l1, ..., P."""
    return torch.tensor(np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]), dtype=torch.long)


def _check_offsets(offsets: Tensor, p: int) -> None:
    # A run mixes with the same offsets tensor every round: it is checked once per content
    # (an in-place change bumps _version) and state size. Between kernel calls the numpy check
    # costs 20-25 us, a sixth of a 10-client x 0.1M-parameter mix.
    stamp = (offsets._version, p)
    if getattr(offsets, "_fedhpc_checked", None) == stamp:
        return
    o = offsets.numpy()
    decreasing = bool((np.diff(o) < 0).any())
    if o[0] != 0 or o[-1] != p or decreasing:
        raise ValueError(f"segment_mix: offsets must rise from 0 to P={p} without decreasing, "
                         f"got {o[0]} .. {o[-1]}{' (decreasing somewhere)' if decreasing else ''}")
    offsets._fedhpc_checked = stamp


def _shapes(a: Tensor, b: Tensor, offsets: Tensor, lam: Tensor):
    if a.dim() not in (1, 2) or b.dim() not in (1, 2):
        raise ValueError(f"segment_mix: a and b must be (P,) or (C, P), got {tuple(a.shape)} and {tuple(b.shape)}")
    if lam.dim() not in (1, 2):
        raise ValueError(f"segment_mix: lam must be (S,) or (C, S), got {tuple(lam.shape)}")
    p = a.shape[-1]
    if b.shape[-1] != p:
        raise ValueError(f"segment_mix: a and b have different state sizes {p} and {b.shape[-1]}")
    clients = {t.shape[0] for t in (a, b, lam) if t.dim() == 2}
    if len(clients) > 1:
        raise ValueError(f"segment_mix: a, b and lam disagree on the number of clients: {sorted(clients)}")
    if offsets.dim() != 1 or offsets.dtype != torch.long or offsets.numel() < 2:
        raise ValueError("segment_mix: offsets must be a 1-D int64 tensor of S+1 >= 2 segment boundaries")
    s = offsets.numel() - 1
    if lam.shape[-1] != s:
        raise ValueError(f"segment_mix: lam has {lam.shape[-1]} coefficients per client for {s} segments")
    if offsets.device.type == "cpu":  # device offsets would need a sync to check: the caller's word
        _check_offsets(offsets, p)
    return (clients.pop(), p) if clients else (None, p)


def segment_mix(a: Tensor, b: Tensor, offsets: Tensor, lam: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """out = lam_seg * a + (1 - lam_seg) * b over flat states, one coefficient per segment.

    a: (P,) or (C, P) (e.g. a batch of C client states); b: (P,) (e.g. the global state) or
    (C, P); offsets: int64 (S+1,) segment boundaries 0 = o_0 <= ... <= o_S = P (empty segments
    allowed); lam: (S,) (same coefficients for every client) or (C, S), converted to a's dtype
    first. Returns (C, P) if any input has a client dimension, else (P,).

    ``out`` (same shape, a's dtype) receives the result; ``out=a`` or ``out=b`` mixes in place
    (any row stride), a partial overlap is refused. Native kernels run for float32/float64 on
    CPU or CUDA when no input needs a gradient; otherwise :func:`fedhpc.ops.reference.segment_mix`
    (one vectorised expression) runs, with bit-identical results.
    """
    clients, p = _shapes(a, b, offsets, lam)
    shape = (clients, p) if clients is not None else (p,)
    if b.dtype != a.dtype or b.device != a.device:
        raise ValueError(f"segment_mix: b must match a's dtype and device ({a.dtype}, {a.device}), "
                         f"got ({b.dtype}, {b.device})")
    if out is not None and (tuple(out.shape) != shape or out.dtype != a.dtype or out.device != a.device):
        raise ValueError(f"segment_mix: out must be {shape} {a.dtype} on {a.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    lam = lam.to(device=a.device, dtype=a.dtype)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (a, b, lam))
    ext = None if grad else _loader.for_tensors(a, b, out)
    if ext is None:
        return reference.segment_mix(a, b, offsets if offsets.device == a.device else offsets.to(a.device), lam, out)
    if a.device.type == "cpu" and offsets.device.type != "cpu":
        offsets = offsets.cpu()
    rows = clients if clients is not None else 1
    # 2-D views for the kernel; a (P,) row is read C times (row stride 0), never copied. Each
    # tensor call here costs 1-3 us once the kernel has evicted Python's objects from the
    # caches: only the views a layout needs are made.
    a2 = a if a.dim() == 2 else a.expand(rows, p)
    b2 = b if b.dim() == 2 else b.expand(rows, p)
    lam2 = lam if lam.dim() == 2 else lam.unsqueeze(0)
    result = out if out is not None else torch.empty(shape, dtype=a.dtype, device=a.device)
    target = result if result.dim() == 2 else result.unsqueeze(0)
    if p > 1 and target.stride(1) != 1:  # e.g. out is a column slice: compute densely, then copy in
        dense = torch.empty((rows, p), dtype=a.dtype, device=a.device)
        ext.segment_mix(a2, b2, offsets, lam2, dense)
        target.copy_(dense)
    else:
        ext.segment_mix(a2, b2, offsets, lam2, target)
    return result
