"""Batched data augmentation on the training device (no torchvision, no per-sample loops).

Why batched: clients hold compact uint8 images; converting and augmenting a whole
mini-batch with a handful of tensor ops on the device that trains on it costs
microseconds, where a per-sample Python/PIL pipeline would dominate a round with
thousands of small clients.

:class:`ImageTransform` is a picklable callable ``(x, train, generator) -> float
tensor`` usable as ``FederatedData.transform``:

* training batches: random crop with zero padding and/or horizontal flip, or
  instead of the padded crop torchvision's RandomResizedCrop rule
  (:func:`random_resized_crop`), then optionally colour jitter
  (:func:`color_jitter`);
* evaluation batches: optionally a centre crop (:func:`center_crop`);
* every batch: uint8 -> float (scaled to [0, 1]), then per-channel normalisation.

The crop and the flip are one ``gather``: per sample a row window and a
(possibly reversed) column window are drawn and turned into flat pixel indices
into the padded batch. The resized crop is one ``grid_sample``. Random numbers
come from ``generator`` (on its own device; moved to the batch's device), drawn
in a fixed order, so the augmentation is reproducible from the engine's seeded
generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


def _randint(high: int, n: int, generator: Optional[torch.Generator], device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.randint(0, high, (n,), generator=generator, device=gen_device).to(device)


def _rand(shape: Tuple[int, ...], generator: Optional[torch.Generator], device) -> torch.Tensor:
    """float64 uniforms in [0, 1), drawn on the generator's device and moved to ``device``."""
    gen_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, device=gen_device, dtype=torch.float64).to(device)


def random_crop_flip(
    x: torch.Tensor, padding: int, flip: bool, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Per-sample random crop (zero padding ``padding`` on each side) and/or horizontal flip.

    ``x`` is (N, C, H, W) of any dtype; the result has the same shape and dtype.
    Draw order: row offsets, column offsets (only if ``padding``), then flip coins.

    Each sample's output pixel (i, j) is padded pixel (oy + i, ox + j), or
    (oy + i, ox + W - 1 - j) when flipped: one flat index per sample and pixel,
    shared by the channels, so the whole batch is a single ``gather`` over the
    flattened padded images (2-3x faster than gathering rows and columns apart).
    """
    if x.dim() != 4:
        raise ValueError(f"random_crop_flip needs (N, C, H, W) images, got shape {tuple(x.shape)}")
    n, c, h, w = x.shape
    if n == 0 or (padding <= 0 and not flip):
        return x
    padding = max(int(padding), 0)
    dev = x.device
    if padding > 0:
        xp = F.pad(x, (padding, padding, padding, padding))
        oy = _randint(2 * padding + 1, n, generator, dev)
        ox = _randint(2 * padding + 1, n, generator, dev)
    else:
        xp = x.contiguous()
        oy = ox = torch.zeros(n, dtype=torch.long, device=dev)
    hp, wp = h + 2 * padding, w + 2 * padding
    rows = oy[:, None] + torch.arange(h, device=dev)  # (N, H)
    cols = ox[:, None] + torch.arange(w, device=dev)  # (N, W)
    if flip:
        coin = _randint(2, n, generator, dev).bool()
        cols = torch.where(coin[:, None], cols.flip(1), cols)
    flat = (rows[:, :, None] * wp + cols[:, None, :]).view(n, 1, h * w).expand(n, c, h * w)
    return xp.reshape(n, c, hp * wp).gather(2, flat).view(n, c, h, w)


#: torchvision's RandomResizedCrop tries this many boxes before its central fallback
RESIZED_CROP_ATTEMPTS = 10

#: ITU-R 601-2 luma weights (R, G, B): the grayscale image colour jitter blends with
GRAY_WEIGHTS = (0.299, 0.587, 0.114)


def _check_range(name: str, lo_hi: Sequence[float], upper: Optional[float]) -> Tuple[float, float]:
    try:
        lo, hi = (float(v) for v in lo_hi)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair (low, high), got {lo_hi!r}")
    if not (0 < lo <= hi and math.isfinite(hi)) or (upper is not None and hi > upper):
        bound = f"0 < low <= high <= {upper:g}" if upper is not None else "0 < low <= high"
        raise ValueError(f"{name} must satisfy {bound}, got ({lo}, {hi})")
    return lo, hi


def resized_crop_boxes(
    n: int, h: int, w: int, scale: Sequence[float], ratio: Sequence[float],
    generator: Optional[torch.Generator] = None, device="cpu",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample crop boxes ``(top, left, height, width)`` (int64, shape (N,) each) of an H x W image.

    The rule is torchvision's RandomResizedCrop, vectorised over the batch: a candidate
    has area ``H * W * s`` with ``s ~ U[scale)`` and aspect ratio (width / height)
    ``r = exp(U[log ratio))``, so width ``round(sqrt(area * r))`` and height
    ``round(sqrt(area / r))`` (round half to even, as Python's ``round``); the first of
    :data:`RESIZED_CROP_ATTEMPTS` candidates with ``0 < width <= W`` and ``0 < height <= H``
    is placed at ``top = floor(u * (H - height + 1))``, ``left = floor(v * (W - width + 1))``.
    When none fits, the fallback is the central crop of the whole image, narrowed to the
    ratio range: width W and height ``round(W / ratio[0])`` if ``W / H < ratio[0]``,
    height H and width ``round(H * ratio[1])`` if ``W / H > ratio[1]``, else the whole
    image; top ``(H - height) // 2``, left ``(W - width) // 2``.

    Draw order (float64 uniforms from ``generator``; all ten candidates are drawn
    whichever fits, so the count, and every later draw, does not depend on the
    images): area fractions (N, 10), log-ratio fractions (N, 10), row offsets u (N,),
    column offsets v (N,).
    """
    s_lo, s_hi = _check_range("scale", scale, 1.0)
    r_lo, r_hi = _check_range("ratio", ratio, None)
    k = RESIZED_CROP_ATTEMPTS
    u_area = _rand((n, k), generator, device)
    u_ratio = _rand((n, k), generator, device)
    u_top = _rand((n,), generator, device)
    u_left = _rand((n,), generator, device)

    area = float(h * w) * (s_lo + (s_hi - s_lo) * u_area)
    log_lo, log_hi = math.log(r_lo), math.log(r_hi)
    aspect = torch.exp(log_lo + (log_hi - log_lo) * u_ratio)
    cand_w = torch.round(torch.sqrt(area * aspect))
    cand_h = torch.round(torch.sqrt(area / aspect))
    fits = (cand_w > 0) & (cand_w <= w) & (cand_h > 0) & (cand_h <= h)
    first = fits.to(torch.uint8).argmax(1, keepdim=True)  # argmax returns the first maximum
    found = fits.any(1)

    in_ratio = w / h
    if in_ratio < r_lo:
        fb_w, fb_h = w, int(round(w / r_lo))
    elif in_ratio > r_hi:
        fb_w, fb_h = int(round(h * r_hi)), h
    else:
        fb_w, fb_h = w, h
    bw = torch.where(found, cand_w.gather(1, first).squeeze(1), torch.full_like(u_top, fb_w))
    bh = torch.where(found, cand_h.gather(1, first).squeeze(1), torch.full_like(u_top, fb_h))
    # min(): u * m can round up to m for u just below 1
    top = torch.minimum(torch.floor(u_top * (h - bh + 1)), h - bh)
    left = torch.minimum(torch.floor(u_left * (w - bw + 1)), w - bw)
    top = torch.where(found, top, torch.full_like(top, (h - fb_h) // 2))
    left = torch.where(found, left, torch.full_like(left, (w - fb_w) // 2))
    return top.long(), left.long(), bh.long(), bw.long()


def _source_coords(offset: torch.Tensor, extent: torch.Tensor, size: int, full: int) -> torch.Tensor:
    """grid_sample coordinates (N, size) of resizing rows [offset, offset + extent) to ``size``.

    ``F.interpolate(crop, mode="bilinear", align_corners=False)`` reads output pixel i
    at crop coordinate ``(i + 0.5) * extent / size - 0.5`` (pixel k's centre at k),
    clamped to [0, extent - 1], so the crop's edge pixels repeat instead of blending
    with pixels outside it. Shifted by ``offset`` into the full image and mapped to
    grid_sample's ``align_corners=False`` units, ``g = (2 p + 1) / full - 1``.
    """
    i = torch.arange(size, dtype=torch.float64, device=offset.device)
    ext = extent.to(torch.float64)[:, None]
    src = ((i + 0.5) * ext / size - 0.5).clamp_(min=0.0)
    src = torch.minimum(src, ext - 1.0) + offset.to(torch.float64)[:, None]
    return (2.0 * src + 1.0) / full - 1.0


def random_resized_crop(
    x: torch.Tensor, size: int, scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0), generator: Optional[torch.Generator] = None,
    flip: bool = False,
) -> torch.Tensor:
    """Per-sample RandomResizedCrop to ``size x size`` (and with ``flip`` a horizontal flip).

    ``x`` is (N, C, H, W); float images keep their dtype, others (uint8) become float32
    with their values unchanged (0..255). Boxes: :func:`resized_crop_boxes` (its draws
    first), then with ``flip`` one coin per sample (``randint(2)``, as
    :func:`random_crop_flip`).

    Resampling: the whole batch is one bilinear ``F.grid_sample`` (``align_corners=
    False``: -1 and 1 are the outer edges of the image, pixel k's centre is at
    ``(2 k + 1) / W - 1``) on a per-sample grid built to reproduce cropping the box and
    resizing the crop with ``F.interpolate(crop, (size, size), mode="bilinear",
    align_corners=False)``: output pixel i reads crop coordinate ``(i + 0.5) * extent /
    size - 0.5`` (the same pixel-centre convention), clamped into the crop so that its
    edge pixels repeat as F.interpolate's do rather than blend with the pixels just
    outside the box (:func:`_source_coords`). The two agree to float rounding (~1e-6
    of the value range). A flip reverses the column coordinates, i.e. mirrors the output.

    Unlike torchvision, nothing antialiases: torchvision resizes tensors with
    ``antialias=True`` (and PIL images always filter over the whole shrunk footprint),
    which differs from plain bilinear only where the box is larger than the output in
    a direction (height or width > ``size``, a shrink); an enlarged box, the usual
    case at small scales, is the same bilinear interpolation either way. On 256-px
    stored images cropped to 224 a shrink is at most 256 / 224 = 1.14x, so the
    aliasing it leaves is slight.
    """
    if x.dim() != 4:
        raise ValueError(f"random_resized_crop needs (N, C, H, W) images, got shape {tuple(x.shape)}")
    if int(size) < 1:
        raise ValueError(f"random_resized_crop size must be positive, got {size}")
    size = int(size)
    if not x.is_floating_point():
        x = x.float()
    n, c, h, w = x.shape
    if n == 0:
        return x.new_empty((0, c, size, size))
    dev = x.device
    top, left, bh, bw = resized_crop_boxes(n, h, w, scale, ratio, generator, dev)
    gy = _source_coords(top, bh, size, h)
    gx = _source_coords(left, bw, size, w)
    if flip:
        coin = _randint(2, n, generator, dev).bool()
        gx = torch.where(coin[:, None], gx.flip(1), gx)
    grid = torch.empty((n, size, size, 2), dtype=x.dtype, device=dev)
    grid[..., 0] = gx[:, None, :].to(x.dtype)
    grid[..., 1] = gy[:, :, None].to(x.dtype)
    # the grid never leaves the box's pixel centres, so the padding mode is never read
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _gray_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(N, 1, H, W) luma of RGB images (ITU-R 601-2) written into ``out``; 1 channel: a copy."""
    if x.shape[1] == 1:
        return out.copy_(x)
    r, g, b = GRAY_WEIGHTS
    return torch.mul(x[:, 0:1], r, out=out).add_(x[:, 1:2], alpha=g).add_(x[:, 2:3], alpha=b)


#: the colour jitter operations, in the order their factors are drawn
JITTER_OPS = ("brightness", "contrast", "saturation")


def color_jitter(
    x: torch.Tensor, brightness: float = 0.0, contrast: float = 0.0, saturation: float = 0.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Per-sample colour jitter of float images in [0, 1] (before normalisation), torchvision's rule.

    Each enabled operation (strength s > 0) has a per-sample factor f ~ U[max(0, 1 - s),
    1 + s) and blends the image with a reference, clamped to [0, 1]:
    brightness ``clamp(f x)``; contrast ``clamp(f x + (1 - f) m)``, m the mean over the
    image of its grayscale; saturation ``clamp(f x + (1 - f) gray(x))``; gray =
    0.299 R + 0.587 G + 0.114 B (ITU-R 601-2; a 1-channel image is its own gray).
    Unclamped the three commute (each is linear, and the gray of a blend with gray is
    the same gray), so only the clamps make the order matter; like torchvision (a fresh
    random order per call, i.e. per image), each sample applies the enabled operations
    in its own uniformly random order, batched: stage t blends every sample with the
    reference of its own t-th operation.

    Draw order (float64 uniforms, only for the enabled operations, taken in
    :data:`JITTER_OPS` order): factors (N, k), then if k > 1 order keys (N, k), whose
    per-row ``argsort`` is the order of application. Strength 0 skips the operation
    (no draws). Returns a new tensor of x's dtype; ``x`` is left alone.
    """
    if x.dim() != 4:
        raise ValueError(f"color_jitter needs (N, C, H, W) images, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"color_jitter needs float images in [0, 1], got dtype {x.dtype}")
    return _color_jitter_(x.clone(), (brightness, contrast, saturation), generator)


def _color_jitter_(x: torch.Tensor, strengths: Sequence[float], generator: Optional[torch.Generator]) -> torch.Tensor:
    """:func:`color_jitter` in place on ``x`` (a tensor the caller owns)."""
    strengths = tuple(float(s) for s in strengths)
    for name, s in zip(JITTER_OPS, strengths):
        if not (s >= 0 and math.isfinite(s)):
            raise ValueError(f"color_jitter {name} must be a finite number >= 0, got {s}")
    ops = [i for i, s in enumerate(strengths) if s > 0]
    n, c, h, w = x.shape
    uses_gray = any(i > 0 for i in ops)
    if uses_gray and c not in (1, 3):
        raise ValueError(f"color_jitter contrast / saturation need 1 or 3 channels, got {c}")
    if n == 0 or not ops:
        return x
    dev, k = x.device, len(ops)
    lo = torch.tensor([max(0.0, 1.0 - strengths[i]) for i in ops], dtype=torch.float64, device=dev)
    hi = torch.tensor([1.0 + strengths[i] for i in ops], dtype=torch.float64, device=dev)
    factors = lo + (hi - lo) * _rand((n, k), generator, dev)
    order = _rand((n, k), generator, dev).argsort(1) if k > 1 else torch.zeros((n, 1), dtype=torch.long, device=dev)
    kinds = torch.tensor(ops, device=dev)[order]  # (N, k): the operation each stage applies
    factors = factors.gather(1, order).to(x.dtype)
    # in place, with one gray buffer: every fresh image-sized tensor costs as much as a pass
    gray = torch.empty((n, 1, h, w), dtype=x.dtype, device=dev) if uses_gray else None
    for t in range(k):
        f = factors[:, t].view(n, 1, 1, 1)
        if gray is None:  # brightness alone: the reference is black
            x.mul_(f).clamp_(0.0, 1.0)
            continue
        # f x + (1 - f) ref, ref = black (brightness), the gray mean (contrast) or the gray image
        # (saturation): per sample (1 - f) ref = gray * a + b, a and b zero where they do not apply
        kind = kinds[:, t].view(n, 1, 1, 1)
        _gray_into(x, gray)
        a = (1 - f) * (kind == 2).to(x.dtype)
        b = (1 - f) * (kind == 1).to(x.dtype) * gray.mean((2, 3), keepdim=True)
        x.mul_(f).add_(gray.mul_(a).add_(b)).clamp_(0.0, 1.0)
    return x


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """The central ``size x size`` window of every image (a view), as torchvision's CenterCrop.

    Top ``round((H - size) / 2)``, left ``round((W - size) / 2)`` (Python's round, half
    to even, as CenterCrop); for an even margin (256 -> 224) the crop is exactly central.
    """
    if x.dim() != 4:
        raise ValueError(f"center_crop needs (N, C, H, W) images, got shape {tuple(x.shape)}")
    h, w = x.shape[-2:]
    if not 1 <= size <= min(h, w):
        raise ValueError(f"center_crop size {size} does not fit the {h}x{w} images (1 <= size <= {min(h, w)})")
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return x[:, :, top:top + size, left:left + size]


@dataclass
class ImageTransform:
    """uint8/float images -> normalised float images, with training-time augmentation.

    ``mean``/``std`` are per channel in [0, 1] units (None: no normalisation).
    ``crop_padding`` > 0 enables random crops; ``flip`` horizontal flips (training only).
    ``resized_crop`` > 0: training batches become ``resized_crop`` x ``resized_crop``
    RandomResizedCrops (``resized_crop_scale``, ``resized_crop_ratio``; instead of the
    padded crop, so ``crop_padding`` must be 0), flipped with ``flip``.
    ``brightness``/``contrast``/``saturation`` > 0: colour jitter of training batches.
    ``center_crop`` > 0: evaluation batches are their central ``center_crop`` square.

    Training order: crop (padded, or resized with its flip), flip (padded path), then
    uint8 -> [0, 1], jitter, normalisation; the random draws follow that order
    (:func:`random_crop_flip`, :func:`random_resized_crop`, :func:`color_jitter` say
    theirs). With the resized crop and jitter off, the padded crop and flip run on the
    stored dtype exactly as before those options existed (same draws, same bits).
    """

    mean: Optional[Sequence[float]] = None
    std: Optional[Sequence[float]] = None
    crop_padding: int = 0
    flip: bool = False
    resized_crop: int = 0
    resized_crop_scale: Tuple[float, float] = (0.08, 1.0)
    resized_crop_ratio: Tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
    brightness: float = 0.0
    contrast: float = 0.0
    saturation: float = 0.0
    center_crop: int = 0
    _cache: Dict[Tuple[str, torch.dtype, float], Tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self):
        if (self.mean is None) != (self.std is None):
            raise ValueError("give both mean and std, or neither")
        if self.mean is not None:
            self.mean = tuple(float(m) for m in self.mean)
            self.std = tuple(float(s) for s in self.std)
            if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
                raise ValueError(f"mean {self.mean} and std {self.std} must match in length, std > 0")
        if self.crop_padding < 0:
            raise ValueError(f"crop_padding must be >= 0, got {self.crop_padding}")
        if self.resized_crop < 0 or self.center_crop < 0:
            raise ValueError(f"resized_crop and center_crop must be >= 0 (0 = off), got "
                             f"{self.resized_crop} and {self.center_crop}")
        if self.resized_crop > 0 and self.crop_padding > 0:
            raise ValueError("resized_crop replaces the padded random crop: set crop_padding to 0")
        self.resized_crop_scale = _check_range("resized_crop_scale", self.resized_crop_scale, 1.0)
        self.resized_crop_ratio = _check_range("resized_crop_ratio", self.resized_crop_ratio, None)
        for name in JITTER_OPS:
            v = float(getattr(self, name))
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} jitter must be a finite number >= 0 (0 = off), got {v}")
            setattr(self, name, v)

    @property
    def jitters(self) -> bool:
        """Colour jitter at training time (some strength > 0)."""
        return self.brightness > 0 or self.contrast > 0 or self.saturation > 0

    @property
    def augments(self) -> bool:
        """Random crops, flips or jitter at training time (the engine then seeds a generator per epoch)."""
        return self.crop_padding > 0 or self.flip or self.resized_crop > 0 or self.jitters

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    def _affine(self, device, dtype, scale: float, channels: int):
        """Per-channel (multiplier, offset) so that out = x * m + o == (x * scale - mean) / std."""
        key = (str(device), dtype, scale)
        hit = self._cache.get(key)
        if hit is None:
            if self.mean is None:
                m = torch.full((1,), scale, dtype=dtype, device=device)
                o = torch.zeros(1, dtype=dtype, device=device)
            else:
                std = torch.tensor(self.std, dtype=torch.float64)
                mean = torch.tensor(self.mean, dtype=torch.float64)
                m = (scale / std).to(device=device, dtype=dtype)
                o = (-mean / std).to(device=device, dtype=dtype)
            hit = self._cache[key] = (m.view(1, -1, 1, 1), o.view(1, -1, 1, 1))
        m, o = hit
        if self.mean is not None and m.shape[1] != channels:
            raise ValueError(f"normalisation has {m.shape[1]} channels, batch has {channels}")
        return m, o

    def _resampled(self, x: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        """Training with the resized crop and/or jitter: both work on [0, 1] floats."""
        if self.resized_crop == 0 and (self.crop_padding > 0 or self.flip):
            x = random_crop_flip(x, self.crop_padding, self.flip, generator)  # cheaper on the stored dtype
        out_dtype = x.dtype if x.is_floating_point() else torch.float32
        out = x.to(out_dtype, copy=True)
        if x.dtype == torch.uint8:
            out.div_(255.0)
        if self.resized_crop > 0:
            out = random_resized_crop(out, self.resized_crop, self.resized_crop_scale, self.resized_crop_ratio,
                                      generator, flip=self.flip)
        if self.jitters:  # ``out`` is this call's own tensor: jitter it in place
            out = _color_jitter_(out, (self.brightness, self.contrast, self.saturation), generator)
        m, o = self._affine(out.device, out_dtype, 1.0, out.shape[1])
        return out.mul_(m).add_(o)

    def __call__(self, x: torch.Tensor, train: bool, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"ImageTransform needs (N, C, H, W) batches, got shape {tuple(x.shape)}")
        if train and (self.resized_crop > 0 or self.jitters):
            return self._resampled(x, generator)
        if train and (self.crop_padding > 0 or self.flip):
            x = random_crop_flip(x, self.crop_padding, self.flip, generator)
        if not train and self.center_crop > 0:
            x = center_crop(x, self.center_crop)
        scale = 1.0 / 255.0 if x.dtype == torch.uint8 else 1.0
        out_dtype = x.dtype if x.is_floating_point() else torch.float32
        m, o = self._affine(x.device, out_dtype, scale, x.shape[1])
        # in place on the fresh float copy: two passes, ~2x faster than addcmul's broadcast
        out = x.to(out_dtype, copy=True)
        return out.mul_(m).add_(o)


def token_ids(x: torch.Tensor, train: bool, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Compactly stored character ids (uint8) -> int64 ids for an embedding layer."""
    return x.long()
