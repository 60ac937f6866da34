"""Batched augmentation: crops, flips and normalisation checked against brute force."""

import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedhpc.data.augment import ImageTransform, random_crop_flip, token_ids


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
