"""Sample codecs of the XorMixFL paper (003: XOR Mixup, Shin et al. 2020): pure functions on uint8 pixels.

What a device does to the samples it uploads, and what the server does to decode them
(the one-shot family around them is :mod:`fedhpc.algorithms.oneshot`). The tests check
each against a hand computation.

* The uint8 pixel domain (:func:`to_pixels`, :func:`from_pixels`). XOR is bitwise on
  8-bit pixels (paper Eqs. 2-3), so samples are handled as uint8 from the device's
  stored data to the server's decoded sample. Image datasets stored as uint8 (MNIST,
  CIFAR, ...) are used as they are: no float round trip touches a bit. Datasets stored
  as floats in [0, 1] (the embedded digits, 0..16 / 16) are quantised once with
  ``round(255 x)`` (exact for uint8-origin data, where x = k / 255) and mapped back with
  ``p / 255`` only where a sample joins the server's training set.
* Sample blending (Eq. 1, garbled in the text; authors' code: "averages of 2 images at
  0.5/0.5" stored as uint8): up to M samples s_1..s_m of one label, drawn without
  replacement, blended pairwise in draw order, b_1 = s_1, b_k = floor(alpha * b_{k-1} +
  (1 - alpha) * s_k), computed in float64 and cast back to uint8 by truncation after
  every step (numpy / TensorFlow ``astype(uint8)`` semantics; for M = 2, alpha = 0.5 it
  is the authors' truncated average). m = min(M, samples of the label held).
  ``rule="saturating_sum"`` instead adds the m samples and caps at 255 (no ratio): not the
  paper's text (it says the samples are "averaged ... as done in Vanilla Mixup"), but the one
  reading found under which Table 3's distances grow with M (benchmarks/RESULTS.md), kept so
  that a sweep can test it.
* XOR encoding (Eq. 2) on the device: e = b(target) XOR b(dummy_1) XOR ... XOR
  b(dummy_D), the D dummy labels (Table 4's "number of dummy labels") drawn per sample
  from the non-target labels the device holds. Decoding (Eq. 3) on the server: d = e XOR
  b'(dummy_1) XOR ... with b' the server's own blends of the same dummy labels. When
  b' = b the result is b(target) bit for bit; otherwise a synthetic, noisy sample of
  the target label. Several dummy labels are chained (each XOR is its own inverse):
  the reading under which Table 3's distance grows with the number of dummy labels.
* MixFL's vanilla-mixup encoding (the paper's ablation; authors: "fixed 0.5 pixel mix
  with a 0.5/0.5 soft label"): floor(lam * b(target) + (1 - lam) / D * sum b(dummy_i))
  with the soft label lam on the target and (1 - lam) / D on each dummy; no decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ...errors import DataError

# --------------------------------------------------------------------------- the uint8 pixel domain


def to_pixels(x: torch.Tensor) -> torch.Tensor:
    """Stored inputs -> uint8 pixels: uint8 as is; floats in [0, 1] as round(255 x)."""
    if x.dtype == torch.uint8:
        return x
    if not x.is_floating_point():
        raise DataError(f"XOR mixup works on image pixels; got inputs of type {x.dtype} (text?)")
    lo, hi = (float(x.min()), float(x.max())) if x.numel() else (0.0, 0.0)
    if lo < 0 or hi > 1:
        raise DataError(f"float inputs must be raw pixels in [0, 1] to map onto uint8 for XOR mixup; got values "
                        f"in [{lo:g}, {hi:g}] (a normalised store?)")
    return torch.round(x.double() * 255).to(torch.uint8)


def from_pixels(p: torch.Tensor, like: torch.dtype) -> torch.Tensor:
    """uint8 pixels -> the dataset's stored form (uint8 stays uint8, floats get p / 255)."""
    if like == torch.uint8:
        return p
    return p.to(torch.float64).div(255).to(like)


# --------------------------------------------------------------------------- blending and codecs


BLEND_RULES = ("average", "saturating_sum")


def blend(samples: torch.Tensor, alpha: float, rule: str = "average") -> torch.Tensor:
    """Iterated pairwise blending (Eq. 1) of uint8 samples (m, ...) in order -> one uint8 sample;
    ``rule="saturating_sum"``: min(255, s_1 + ... + s_m), ``alpha`` unused."""
    if samples.dtype != torch.uint8 or samples.shape[0] < 1:
        raise DataError(f"blend takes a non-empty uint8 stack of samples, got {samples.dtype} {tuple(samples.shape)}")
    if rule == "saturating_sum":
        return samples.to(torch.int32).sum(0).clamp(max=255).to(torch.uint8)
    if rule != "average":
        raise DataError(f"unknown blend rule {rule!r}; choose one of {', '.join(BLEND_RULES)}")
    out = samples[0]
    for s in samples[1:]:
        out = (alpha * out.double() + (1 - alpha) * s.double()).floor().clamp(0, 255).to(torch.uint8)
    return out


def draw_blend(pixels: torch.Tensor, members: torch.Tensor, max_blend: int, alpha: float,
               generator: torch.Generator, rule: str = "average") -> Tuple[torch.Tensor, torch.Tensor]:
    """Blend of min(M, len(members)) rows of ``pixels`` drawn without replacement from ``members``.

    Returns (blended sample, the rows used in blending order)."""
    pick = members[torch.randperm(len(members), generator=generator)[:max_blend]]
    return blend(pixels[pick], alpha, rule), pick


def xor_chain(first: torch.Tensor, others: Sequence[torch.Tensor]) -> torch.Tensor:
    """first XOR others[0] XOR ...: Eq. 2 (encoding) and Eq. 3 (decoding) alike."""
    out = first.clone()
    for o in others:
        out = torch.bitwise_xor(out, o)
    return out


def mix_encode(target: torch.Tensor, dummies: Sequence[torch.Tensor], lam: float) -> torch.Tensor:
    """MixFL: floor(lam * target + (1 - lam) / D * sum(dummies)) in uint8."""
    acc = lam * target.double()
    for d in dummies:
        acc = acc + (1 - lam) / len(dummies) * d.double()
    return acc.floor().clamp(0, 255).to(torch.uint8)


# --------------------------------------------------------------------------- the upload


@dataclass
class EncodedSet:
    """Encoded samples with their provenance (uint8 pixels; the device's own rows behind each).

    ``target``: the target label of each sample; ``dummies``: (n, D) its dummy labels;
    ``owner``/``index``: uploading device and position; ``source_index``: (n, S) rows of
    the owner's training data blended into it (target rows first), -1 padded;
    ``soft``: MixFL's soft labels (n, C), None for XOR samples; ``blend_sizes``: (n, 1 + D) how
    many rows each blend took (target first, then each dummy), min(M, rows of the label held).
    """

    x: torch.Tensor
    target: torch.Tensor
    dummies: torch.Tensor
    owner: torch.Tensor
    index: torch.Tensor
    source_index: torch.Tensor
    kind: str = "xor"
    soft: Optional[torch.Tensor] = None
    blend_sizes: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return int(self.target.shape[0])

    @property
    def source_cid(self) -> torch.Tensor:
        """(n, 1): every source of a sample is its owner's (the shape the privacy audit takes)."""
        return self.owner[:, None]

    def wire_bytes(self) -> int:
        return len(self) * self.row_bytes()

    def row_bytes(self) -> int:
        """8 bits per pixel (as Mix2FLD's b_s) plus one byte per label id (target and dummies)."""
        return self.x.shape[1:].numel() + 1 + int(self.dummies.shape[1])

    @staticmethod
    def cat(parts: List["EncodedSet"]) -> "EncodedSet":
        parts = [p for p in parts if len(p)]
        if not parts:
            raise DataError("no device uploaded an encoded sample: no training device holds a target label; give "
                            "the devices some (e.g. a deficient:L:A:B partition with A > 0) or lower "
                            "--cold-start-fraction, whose held-out devices upload nothing")
        width = max(int(p.source_index.shape[1]) for p in parts)
        pad = [F.pad(p.source_index, (0, width - p.source_index.shape[1]), value=-1) for p in parts]
        soft = None if parts[0].soft is None else torch.cat([p.soft for p in parts])
        sizes = None if any(p.blend_sizes is None for p in parts) else torch.cat([p.blend_sizes for p in parts])
        return EncodedSet(torch.cat([p.x for p in parts]), torch.cat([p.target for p in parts]),
                          torch.cat([p.dummies for p in parts]), torch.cat([p.owner for p in parts]),
                          torch.cat([p.index for p in parts]), torch.cat(pad), parts[0].kind, soft, sizes)

    def select(self, rows: torch.Tensor) -> "EncodedSet":
        return EncodedSet(self.x[rows], self.target[rows], self.dummies[rows], self.owner[rows], self.index[rows],
                          self.source_index[rows], self.kind, None if self.soft is None else self.soft[rows],
                          None if self.blend_sizes is None else self.blend_sizes[rows])


def encode_device(pixels: torch.Tensor, labels: torch.Tensor, requests: Dict[int, int], targets: Sequence[int],
                  num_dummy: int, max_blend: int, alpha: float, generator: torch.Generator, cid: int,
                  kind: str = "xor", lam: float = 0.5, num_classes: int = 0,
                  dummy_pool: Optional[Sequence[int]] = None, rule: str = "average") -> EncodedSet:
    """One device's upload (Alg. 1): ``requests[t]`` encoded samples of each target label t.

    Per sample, in (target label, position) order: the target blend, then D dummy labels
    (a uniform draw without replacement among the non-target labels the device holds, within
    ``dummy_pool`` when given, in drawn order), then each dummy's blend, all from ``generator``. ``kind``: "xor" (Eq. 2)
    or "mix" (MixFL, ratio ``lam``, soft labels over ``num_classes``); ``rule``: :func:`blend`'s.
    """
    held = set(torch.unique(labels).tolist())
    allowed = held if dummy_pool is None else held & set(int(d) for d in dummy_pool)
    candidates = torch.tensor(sorted(allowed - set(int(t) for t in targets)), dtype=torch.long)
    members = {c: (labels == c).nonzero().flatten() for c in held}
    xs, tg, dm, src, soft, sizes = [], [], [], [], [], []
    for t in sorted(requests):
        if requests[t] <= 0:
            continue
        if t not in held:
            raise DataError(f"device {cid} was asked for samples of label {t}, which it does not hold")
        if len(candidates) < num_dummy:
            raise DataError(f"device {cid} holds {len(candidates)} usable non-target label(s) {candidates.tolist()}, "
                            f"fewer than the {num_dummy} dummy labels each encoded sample needs; lower --num-dummy "
                            f"or widen --dummy-labels")
        for _ in range(requests[t]):
            b_t, rows_t = draw_blend(pixels, members[t], max_blend, alpha, generator, rule)
            dummy = candidates[torch.randperm(len(candidates), generator=generator)[:num_dummy]]
            blends, rows = [], [rows_t]
            for d in dummy.tolist():
                b_d, rows_d = draw_blend(pixels, members[d], max_blend, alpha, generator, rule)
                blends.append(b_d)
                rows.append(rows_d)
            if kind == "xor":
                xs.append(xor_chain(b_t, blends))
            else:
                xs.append(mix_encode(b_t, blends, lam))
                y = torch.zeros(num_classes, dtype=torch.float64)
                y[t] = lam
                y[dummy] += (1 - lam) / num_dummy
                soft.append(y)
            tg.append(t)
            dm.append(dummy)
            src.append(torch.cat(rows))
            sizes.append([len(r) for r in rows])
    n = len(xs)
    width = max((len(r) for r in src), default=0)
    return EncodedSet(
        x=torch.stack(xs) if n else pixels[:0], target=torch.tensor(tg, dtype=torch.long),
        dummies=torch.stack(dm) if n else torch.zeros(0, num_dummy, dtype=torch.long),
        owner=torch.full((n,), cid, dtype=torch.long), index=torch.arange(n),
        source_index=torch.stack([F.pad(r, (0, width - len(r)), value=-1) for r in src]) if n
        else torch.zeros(0, 0, dtype=torch.long),
        kind=kind, soft=(torch.stack(soft) if n else torch.zeros(0, num_classes, dtype=torch.float64))
        if kind == "mix" else None,
        blend_sizes=torch.tensor(sizes, dtype=torch.long).reshape(n, 1 + num_dummy))


def xor_decode(encoded: EncodedSet, server_pixels: torch.Tensor, server_labels: torch.Tensor, max_blend: int,
               alpha: float, generator: torch.Generator, rule: str = "average") -> Tuple[torch.Tensor, torch.Tensor]:
    """Alg. 2: every encoded sample XOR the server's own blends of its dummy labels (Eq. 3).

    Sample by sample in the set's order, each dummy's blend drawn from ``generator`` among
    the server's samples of that label. Returns (decoded uint8 samples, (n, D * M) server
    rows used, -1 padded)."""
    members = {c: (server_labels == c).nonzero().flatten() for c in torch.unique(server_labels).tolist()}
    out, used = [], []
    for i in range(len(encoded)):
        blends, rows = [], []
        for d in encoded.dummies[i].tolist():
            if d not in members:
                raise DataError(f"the server holds no sample of dummy label {d}, so it cannot decode (Eq. 3)")
            b, r = draw_blend(server_pixels, members[d], max_blend, alpha, generator, rule)
            blends.append(b)
            rows.append(r)
        out.append(xor_chain(encoded.x[i], blends))
        used.append(torch.cat(rows))
    width = max((len(r) for r in used), default=0)
    rows = torch.stack([F.pad(r, (0, width - len(r)), value=-1) for r in used]) if used else torch.zeros(0, 0)
    return (torch.stack(out) if out else encoded.x[:0]), rows.long()
