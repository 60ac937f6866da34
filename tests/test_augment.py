"""Batched augmentation: crops, flips and normalisation checked against brute force."""

import math
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedhpc.data.augment import (ImageTransform, center_crop, color_jitter, random_crop_flip, random_resized_crop,
                                 resized_crop_boxes, token_ids)


def batch(n=32, c=3, h=8, w=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, c, h, w), generator=g, dtype=torch.uint8)


def candidates(img, pad, flip):
    """Every crop (and its mirror) a sample may legally become."""
    c, h, w = img.shape
    padded = F.pad(img[None], (pad, pad, pad, pad))[0]
    out = []
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            crop = padded[:, dy:dy + h, dx:dx + w]
            out.append(crop)
            if flip:
                out.append(crop.flip(-1))
    return out


def test_eval_is_exact_normalisation_without_augmentation():
    x = batch()
    mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
    t = ImageTransform(mean=mean, std=std, crop_padding=4, flip=True)
    out = t(x, False, torch.Generator().manual_seed(1))
    ref = (x.double() / 255.0 - torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)) \
        / torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_no_normalisation_scales_uint8_and_passes_floats():
    x = batch()
    t = ImageTransform()
    assert torch.allclose(t(x, False), x.float() / 255.0)
    xf = torch.rand(4, 1, 5, 5)
    assert torch.equal(t(xf, True), xf)
    t2 = ImageTransform(mean=(0.5,), std=(0.25,))
    assert torch.allclose(t2(xf, False), (xf - 0.5) / 0.25)


def test_random_crop_with_padding_gives_true_crops():
    x = batch(n=48, h=6, w=7)
    pad = 2
    out = random_crop_flip(x, pad, flip=False, generator=torch.Generator().manual_seed(3))
    assert out.shape == x.shape and out.dtype == x.dtype
    positions = set()
    for i in range(len(x)):
        cands = candidates(x[i], pad, flip=False)
        hits = [k for k, cand in enumerate(cands) if torch.equal(cand, out[i])]
        assert hits, f"sample {i} is not a crop of its padded input"
        positions.add(hits[0])
    assert len(positions) > 5, "crop offsets must vary across the batch"


def test_flip_only_mirrors_some_samples():
    x = batch(n=64)
    out = random_crop_flip(x, 0, flip=True, generator=torch.Generator().manual_seed(0))
    same = [torch.equal(out[i], x[i]) for i in range(64)]
    mirrored = [torch.equal(out[i], x[i].flip(-1)) for i in range(64)]
    assert all(s or m for s, m in zip(same, mirrored))
    assert 10 < sum(mirrored) < 54


def test_crop_and_flip_then_normalise_in_training():
    x = batch(n=24)
    t = ImageTransform(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_padding=2, flip=True)
    out = t(x, True, torch.Generator().manual_seed(7))
    assert out.dtype == torch.float32
    raw = torch.round((out * 0.5 + 0.5) * 255).to(torch.uint8)  # undo the normalisation
    flipped = 0
    for i in range(len(x)):
        cands = candidates(x[i], 2, flip=True)
        hits = [k for k, cand in enumerate(cands) if torch.equal(cand, raw[i])]
        assert hits
        flipped += hits[0] % 2
    assert 0 < flipped < len(x)
    # padding is zero before normalisation, i.e. (0 - mean) / std afterwards
    assert (out == -1.0).any()


def test_generator_makes_it_reproducible():
    x = batch()
    t = ImageTransform(crop_padding=4, flip=True)
    a = t(x, True, torch.Generator().manual_seed(11))
    b = t(x, True, torch.Generator().manual_seed(11))
    c = t(x, True, torch.Generator().manual_seed(12))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_single_channel_and_pickling():
    x = batch(n=8, c=1, h=28, w=28)
    t = ImageTransform(mean=(0.1307,), std=(0.3081,), crop_padding=2)
    t(x, True, torch.Generator().manual_seed(0))  # fills the per-device cache
    clone = pickle.loads(pickle.dumps(t))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(t(x, True, g1), clone(x, True, g2))


def test_bad_inputs():
    with pytest.raises(ValueError, match="N, C, H, W"):
        ImageTransform()(torch.zeros(3, 8, 8, dtype=torch.uint8), True)
    with pytest.raises(ValueError, match="channels"):
        ImageTransform(mean=(0.5,), std=(0.5,))(batch(c=3), False)
    with pytest.raises(ValueError, match="mean and std"):
        ImageTransform(mean=(0.5,))
    with pytest.raises(ValueError, match="std > 0"):
        ImageTransform(mean=(0.5,), std=(0.0,))


def test_token_ids_become_int64():
    x = torch.tensor(np.arange(10, dtype=np.uint8)).view(2, 5)
    out = token_ids(x, True, None)
    assert out.dtype == torch.int64 and out.tolist() == x.tolist()


# --------------------------------------------------------------------------- RandomResizedCrop, ColorJitter, CenterCrop
# The references below are per-sample loops written from the rules (RandomResizedCrop's box
# rule, F.interpolate of the cropped box, ColorJitter's formulas), fed with the random numbers
# drawn again from an identically seeded generator in the order the docstrings document.

IMNET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def box_draws(g, n):
    """RandomResizedCrop's documented draws: areas (N, 10), log-ratios (N, 10), rows (N,), columns (N,)."""
    return [torch.rand(shape, generator=g, dtype=torch.float64) for shape in ((n, 10), (n, 10), (n,), (n,))]


def brute_box(u_area, u_ratio, u_top, u_left, h, w, scale, ratio):
    """(top, left, height, width, fell_back) of one sample, torchvision's rule in plain Python."""
    for a, r in zip(u_area.tolist(), u_ratio.tolist()):
        target = h * w * (scale[0] + (scale[1] - scale[0]) * a)
        aspect = math.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * r)
        bw, bh = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < bw <= w and 0 < bh <= h:
            return math.floor(float(u_top) * (h - bh + 1)), math.floor(float(u_left) * (w - bw + 1)), bh, bw, False
    if w / h < ratio[0]:
        bw, bh = w, round(w / ratio[0])
    elif w / h > ratio[1]:
        bw, bh = round(h * ratio[1]), h
    else:
        bw, bh = w, h
    return (h - bh) // 2, (w - bw) // 2, bh, bw, True


def brute_resized_crops(x, size, scale, ratio, g, flip):
    """Per sample: the box from the same draws, then crop + F.interpolate (+ mirror)."""
    n, _, h, w = x.shape
    u_area, u_ratio, u_top, u_left = box_draws(g, n)
    coins = torch.randint(0, 2, (n,), generator=g) if flip else torch.zeros(n, dtype=torch.long)
    out, boxes = [], []
    for i in range(n):
        top, left, bh, bw, fell_back = brute_box(u_area[i], u_ratio[i], u_top[i], u_left[i], h, w, scale, ratio)
        crop = x[i:i + 1, :, top:top + bh, left:left + bw]
        img = F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False)[0]
        out.append(img.flip(-1) if coins[i] else img)
        boxes.append((top, left, bh, bw, fell_back))
    return torch.stack(out), boxes, coins


def brute_jitter(x, strengths, g, fixed_order=False):
    """ColorJitter per sample from its formulas, with the documented draws (factors, order keys);
    ``fixed_order``: brightness, contrast, saturation for every sample instead of the drawn order."""
    ops = [k for k, s in enumerate(strengths) if s > 0]
    n = len(x)
    u = torch.rand((n, len(ops)), generator=g, dtype=torch.float64)
    keys = torch.rand((n, len(ops)), generator=g, dtype=torch.float64) if len(ops) > 1 else torch.zeros(n, 1)
    out = []
    for i in range(n):
        img = x[i].double()
        lo_hi = [(max(0.0, 1 - strengths[op]), 1 + strengths[op]) for op in ops]
        factors = {op: lo + (hi - lo) * float(u[i, j]) for j, (op, (lo, hi)) in enumerate(zip(ops, lo_hi))}
        for j in (range(len(ops)) if fixed_order else sorted(range(len(ops)), key=lambda j: float(keys[i, j]))):
            op, f = ops[j], factors[ops[j]]
            gray = img if img.shape[0] == 1 else (0.299 * img[0] + 0.587 * img[1] + 0.114 * img[2])[None]
            if op == 0:
                img = (f * img).clamp(0, 1)
            elif op == 1:
                img = (f * img + (1 - f) * gray.mean()).clamp(0, 1)
            else:
                img = (f * img + (1 - f) * gray).clamp(0, 1)
        out.append(img)
    return torch.stack(out)


@pytest.mark.parametrize("size", [16, 48])  # mostly shrinking boxes / every box enlarged (edge clamping)
def test_random_resized_crop_is_crop_then_interpolate_per_sample(size):
    g = torch.Generator().manual_seed(4)
    x = torch.rand(40, 3, 29, 41, generator=g)  # not square: the ratio bounds meet the image's
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    out = random_resized_crop(x, size, scale, ratio, torch.Generator().manual_seed(9), flip=True)
    ref, boxes, coins = brute_resized_crops(x, size, scale, ratio, torch.Generator().manual_seed(9), flip=True)
    assert out.shape == (40, 3, size, size) and out.dtype == torch.float32
    assert (out - ref).abs().max() < 1e-5  # float32 rounding; a pixel off would be ~0.1
    assert 5 < int(coins.sum()) < 35 and len({b[:4] for b in boxes}) == 40
    if size == 16:  # both kinds of box are exercised
        assert any(b[2] > size or b[3] > size for b in boxes) and any(b[2] < size and b[3] < size for b in boxes)


def test_resized_crop_boxes_equal_the_rule_and_respect_the_bounds():
    n, h, w = 400, 180, 240
    scale, ratio = (0.2, 0.7), (0.6, 1.5)
    top, left, bh, bw = resized_crop_boxes(n, h, w, scale, ratio, torch.Generator().manual_seed(2))
    draws = box_draws(torch.Generator().manual_seed(2), n)
    for i in range(n):
        expect = brute_box(*(d[i] for d in draws), h, w, scale, ratio)
        assert (int(top[i]), int(left[i]), int(bh[i]), int(bw[i])) == expect[:4]
        assert not expect[4]
    # inside the image; area and aspect within the bounds up to the rounding of the sides
    assert (top >= 0).all() and (left >= 0).all() and (top + bh <= h).all() and (left + bw <= w).all()
    hh, ww = bh.double(), bw.double()
    slack = 0.5 / hh + 0.5 / ww + 0.25 / (hh * ww)
    frac = hh * ww / (h * w)
    assert (frac >= scale[0] * (1 - slack)).all() and (frac <= scale[1] * (1 + slack)).all()
    aspect = ww / hh
    assert (aspect >= ratio[0] * (1 - slack)).all() and (aspect <= ratio[1] * (1 + slack)).all()
    assert frac.min() < scale[0] + 0.05 and frac.max() > scale[1] - 0.05  # the range is covered
    assert len(set(top.tolist())) > 20 and len(set(left.tolist())) > 20


@pytest.mark.parametrize("h,w,ratio,expect,always", [
    (50, 50, (2.0, 3.0), (12, 0, 25, 50), True),   # W / H below the range: full width, height W / 2
    (20, 100, (0.5, 1.0), (0, 40, 20, 20), True),  # above it: full height, width H * 1
    (30, 40, (0.05, 20.0), (0, 0, 30, 40), False),  # inside it: the whole image
])
def test_resized_crop_falls_back_to_the_central_crop(h, w, ratio, expect, always):
    scale = (1.0, 1.0)  # the whole area: only an aspect near W / H fits, or none in the range
    top, left, bh, bw = resized_crop_boxes(64, h, w, scale, ratio, torch.Generator().manual_seed(0))
    draws = box_draws(torch.Generator().manual_seed(0), 64)
    fell = torch.tensor([brute_box(*(d[i] for d in draws), h, w, scale, ratio)[4] for i in range(64)])
    assert bool(fell.all()) if always else 0 < int(fell.sum()) < 64
    assert (torch.stack([top, left, bh, bw], 1)[fell] == torch.tensor(expect)).all()


@pytest.mark.parametrize("strengths,channels", [
    ((0.4, 0.4, 0.4), 3),   # the authors' setting: three operations in a random order per image
    ((0.9, 0.0, 1.5), 3),   # strong factors: the clamps make the order matter
    ((0.0, 0.8, 0.0), 3),   # one operation: no order keys drawn
    ((0.7, 0.0, 0.0), 3),   # brightness alone
    ((0.5, 0.9, 0.6), 1),   # grayscale images: the image is its own gray
])
def test_color_jitter_is_the_per_sample_formulas(strengths, channels):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(48, channels, 6, 7, generator=g) ** 0.5  # bright images: many clamps at 1
    before = x.clone()
    out = color_jitter(x, *strengths, generator=torch.Generator().manual_seed(3))
    ref = brute_jitter(x, strengths, torch.Generator().manual_seed(3))
    assert torch.equal(x, before), "color_jitter must not modify its input"
    assert out.dtype == x.dtype and out.shape == x.shape
    assert (out.double() - ref).abs().max() < 1e-6
    assert out.min() >= 0 and out.max() <= 1 and (out == 1).any()


def test_color_jitter_order_is_drawn_per_sample():
    """With clamps active the fixed orders give different images; each sample takes its own."""
    x = torch.rand(64, 3, 5, 5, generator=torch.Generator().manual_seed(0)) ** 0.3
    keys_g = torch.Generator().manual_seed(6)
    torch.rand((64, 3), generator=keys_g, dtype=torch.float64)  # the factors
    orders = torch.rand((64, 3), generator=keys_g, dtype=torch.float64).argsort(1)
    assert len({tuple(o) for o in orders.tolist()}) == 6  # all six orders occur in the batch
    out = color_jitter(x, 0.9, 0.9, 0.9, torch.Generator().manual_seed(6))
    ref = brute_jitter(x, (0.9, 0.9, 0.9), torch.Generator().manual_seed(6))
    assert (out.double() - ref).abs().max() < 1e-6
    fixed = brute_jitter(x, (0.9, 0.9, 0.9), torch.Generator().manual_seed(6), fixed_order=True)
    assert (out.double() - fixed).abs().max() > 1e-2, "the test images must make the order matter"


def test_center_crop_is_torchvisions_window():
    x = batch(n=4, h=9, w=12)
    assert torch.equal(center_crop(x, 5), x[:, :, 2:7, 4:9])   # margins 4 and 7: round(2) = 2, round(3.5) = 4
    assert torch.equal(center_crop(x, 6), x[:, :, 2:8, 3:9])   # margins 3 and 6: round(1.5) = 2, round(3) = 3
    t = ImageTransform(mean=IMNET[0], std=IMNET[1], center_crop=6, resized_crop=6, flip=True)
    ref = ImageTransform(mean=IMNET[0], std=IMNET[1])(x[:, :, 2:8, 3:9], False)
    assert torch.equal(t(x, False), ref)  # evaluation: the crop, then exactly the old normalisation
    with pytest.raises(ValueError, match="does not fit"):
        center_crop(x, 10)


def test_transform_on_uint8_images_is_the_per_sample_pipeline():
    """uint8 -> [0, 1] -> RandomResizedCrop + flip -> ColorJitter -> normalise, per sample."""
    x = batch(n=24, h=20, w=26, seed=5)
    strengths = (0.4, 0.4, 0.4)
    t = ImageTransform(mean=IMNET[0], std=IMNET[1], flip=True, resized_crop=16, brightness=0.4, contrast=0.4,
                       saturation=0.4, center_crop=16)
    assert t.augments
    out = t(x, True, torch.Generator().manual_seed(8))
    g = torch.Generator().manual_seed(8)  # the documented order: boxes, flip coins, jitter
    crops, _, _ = brute_resized_crops(x.double() / 255, 16, (0.08, 1.0), (3 / 4, 4 / 3), g, flip=True)
    ref = brute_jitter(crops, strengths, g)
    mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in IMNET)
    ref = (ref - mean) / std
    assert out.shape == (24, 3, 16, 16) and out.dtype == torch.float32
    assert (out.double() - ref).abs().max() < 1e-4
    assert torch.equal(x, batch(n=24, h=20, w=26, seed=5)), "the stored batch must not change"


def test_jitter_after_the_padded_crop_and_flip():
    """Without the resized crop, jitter follows the padded crop + flip (whose draws come first)."""
    x = batch(n=16, h=8, w=8, seed=2)
    t = ImageTransform(mean=IMNET[0], std=IMNET[1], crop_padding=2, flip=True, saturation=0.5, contrast=0.3)
    out = t(x, True, torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(4)
    cropped = random_crop_flip(x, 2, True, g)
    ref = brute_jitter(cropped.double() / 255, (0.0, 0.3, 0.5), g)
    mean, std = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in IMNET)
    assert (out.double() - (ref - mean) / std).abs().max() < 1e-5


def test_new_options_off_leave_the_transform_bit_identical():
    """The pre-existing path, written out: crop/flip on the stored dtype, then x * (1/255/std) - mean/std."""
    x = batch(n=20, h=10, w=10, seed=3)
    mean, std = IMNET
    m = (1 / 255.0 / torch.tensor(std, dtype=torch.float64)).float().view(1, 3, 1, 1)
    o = (-torch.tensor(mean, dtype=torch.float64) / torch.tensor(std, dtype=torch.float64)).float().view(1, 3, 1, 1)
    for pad, flip in ((4, True), (0, True), (3, False), (0, False)):
        t = ImageTransform(mean=mean, std=std, crop_padding=pad, flip=flip)
        assert t.augments == (pad > 0 or flip)
        g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        ref = random_crop_flip(x, pad, flip, g2).to(torch.float32).mul_(m).add_(o)
        assert torch.equal(t(x, True, g1), ref)
        assert torch.equal(g1.get_state(), g2.get_state()), "same draws: the stream continues identically"
        assert torch.equal(t(x, False), x.to(torch.float32).mul_(m).add_(o))


def test_resized_crop_and_jitter_are_reproducible_from_the_generator():
    x = batch(n=16, h=12, w=12)
    t = ImageTransform(mean=IMNET[0], std=IMNET[1], flip=True, resized_crop=10, brightness=0.4, contrast=0.4,
                       saturation=0.4)
    a = t(x, True, torch.Generator().manual_seed(3))
    b = pickle.loads(pickle.dumps(t))(x, True, torch.Generator().manual_seed(3))
    c = t(x, True, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    # either option alone makes the engine seed a generator per epoch
    assert ImageTransform(brightness=0.1).augments and ImageTransform(resized_crop=4).augments
    assert not ImageTransform(center_crop=4).augments


@pytest.mark.parametrize("kwargs,match", [
    (dict(resized_crop=-1), "resized_crop and center_crop"),
    (dict(center_crop=-2), "resized_crop and center_crop"),
    (dict(resized_crop=8, crop_padding=4), "crop_padding to 0"),
    (dict(resized_crop_scale=(0.0, 1.0)), "resized_crop_scale"),
    (dict(resized_crop_scale=(0.5, 1.2)), "resized_crop_scale"),
    (dict(resized_crop_scale=(0.6, 0.5)), "resized_crop_scale"),
    (dict(resized_crop_ratio=(-1.0, 2.0)), "resized_crop_ratio"),
    (dict(resized_crop_ratio=(2.0, 1.0)), "resized_crop_ratio"),
    (dict(resized_crop_ratio=(1.0,)), "pair"),
    (dict(brightness=-0.1), "brightness"),
    (dict(saturation=float("nan")), "saturation"),
])
def test_bad_new_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImageTransform(**kwargs)


def test_bad_inputs_of_the_new_functions():
    with pytest.raises(ValueError, match="float images"):
        color_jitter(batch(), 0.4)
    with pytest.raises(ValueError, match="1 or 3 channels"):
        color_jitter(torch.rand(2, 2, 4, 4), 0.0, 0.4)
    with pytest.raises(ValueError, match="N, C, H, W"):
        random_resized_crop(torch.rand(3, 8, 8), 4)
    with pytest.raises(ValueError, match="size must be positive"):
        random_resized_crop(torch.rand(1, 3, 8, 8), 0)
    with pytest.raises(ValueError, match="does not fit"):
        ImageTransform(center_crop=9)(batch(h=8, w=8), False)


def test_imagenet_sized_batch_runs():
    """64 stored 3x256x256 images -> 3x224x224 through the authors' training transform (no timing)."""
    x = torch.randint(0, 256, (64, 3, 256, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    t = ImageTransform(mean=IMNET[0], std=IMNET[1], flip=True, resized_crop=224, brightness=0.4, contrast=0.4,
                       saturation=0.4, center_crop=224)
    out = t(x, True, torch.Generator().manual_seed(0))
    assert out.shape == (64, 3, 224, 224) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert t(x, False).shape == (64, 3, 224, 224)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run on the device machine)")
def test_the_imagenet_transform_on_a_gpu_equals_the_cpu():
    """On a GPU: the authors' ImageNet training transform (resized crop, flip, jitter in a per-sample
    order, normalisation) on a CUDA batch, with the draws from the same CPU generator, gives the CPU's
    tensor; so does the evaluation's centre crop. Float32 interpolation and jitter may differ in the
    last bits between the two devices' kernels, nothing more."""
    x = torch.randint(0, 256, (32, 3, 256, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    t = ImageTransform(mean=IMNET[0], std=IMNET[1], flip=True, resized_crop=224, brightness=0.4, contrast=0.4,
                       saturation=0.4, center_crop=224)
    cpu = t(x, True, torch.Generator().manual_seed(5))
    gpu = t(x.cuda(), True, torch.Generator().manual_seed(5))
    assert gpu.is_cuda and gpu.shape == cpu.shape == (32, 3, 224, 224)
    assert float((gpu.cpu() - cpu).abs().max()) < 1e-4
    assert not torch.allclose(cpu, t(x, True, torch.Generator().manual_seed(6)))  # the draws do matter
    assert torch.equal(t(x.cuda(), False).cpu(), t(x, False))
