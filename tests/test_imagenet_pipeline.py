"""The authors' ImageNet-200 pipeline (RandomResizedCrop + flip + ColorJitter, centre crop) as
imagenet200 data options: validation, how they reach the transform, the launch files that use them.

The transform itself is checked against per-sample brute force in test_augment.
"""

import os
import re
import shlex

import h5py
import numpy as np
import pytest
import torch

from conftest import cfg_for, opts

from fedhpc.algorithms.local_reg import parse_scales, resize
from fedhpc.config import build_options, parse_args
from fedhpc.data import DATASETS, build_dataset, load_dataset_modules
from fedhpc.data.augment import ImageTransform
from fedhpc.data.readers.common import IMAGENET_STATS, image_transform
from fedhpc.errors import ConfigError, DataError

LAUNCH_DIR = os.path.join(os.path.dirname(__file__), "..", "launch")
IMAGENET_FILES = sorted(f for f in os.listdir(LAUNCH_DIR) if f.startswith("fedalign_imagenet200"))


def write_prepared(root, side=12, n=40, n_val=10, classes=4):
    """The layout `python -m fedhpc.data.prepare imagenet200 --size SIDE` writes."""
    rng = np.random.default_rng(0)
    with h5py.File(os.path.join(root, "imagenet200.h5"), "w") as f:
        f["train/x"] = rng.integers(0, 256, (n, 3, side, side), dtype=np.uint8)
        f["train/y"] = np.arange(n) % classes
        f["val/x"] = rng.integers(0, 256, (n_val, 3, side, side), dtype=np.uint8)
        f["val/y"] = np.arange(n_val) % classes
        f.create_dataset("classes", data=np.array([f"n{i:08d}" for i in range(classes)], dtype=object),
                         dtype=h5py.string_dtype())
        f.attrs.update(format="fedhpc-image-subset", num_classes=classes, size=side, seed=0, source="test")


def data_options(**values):
    load_dataset_modules()
    return build_options(DATASETS.get("imagenet200").options, values, "dataset 'imagenet200'")


@pytest.mark.parametrize("values,match", [
    (dict(resized_crop=-1), "resized_crop must be >= 0"),
    (dict(center_crop=-224), "center_crop must be >= 0"),
    (dict(resized_crop=224), "crop_padding: 0"),  # the default crop_padding 8 is on
    (dict(resized_crop=224, crop_padding=0, resized_crop_scale_min=0.0), "0 < min <= max <= 1"),
    (dict(resized_crop=224, crop_padding=0, resized_crop_scale_max=1.5), "0 < min <= max <= 1"),
    (dict(resized_crop_scale_min=0.5, resized_crop_scale_max=0.4), "0 < min <= max <= 1"),
    (dict(resized_crop_ratio_min=-0.75), "0 < min <= max"),
    (dict(resized_crop_ratio_min=1.5, resized_crop_ratio_max=1.2), "0 < min <= max"),
    (dict(jitter_brightness=-0.4), "jitter_brightness is a jitter strength"),
    (dict(jitter_contrast=-1), "jitter_contrast"),
    (dict(jitter_saturation=float("inf")), "jitter_saturation"),
])
def test_bad_pipeline_options_are_config_errors(values, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        data_options(**values)


def test_options_reach_the_transform(tmp_path):
    write_prepared(str(tmp_path), side=12)
    o = opts("imagenet200", store="memory", crop_padding=0, flip=True, resized_crop=8,
             resized_crop_scale_min=0.25, resized_crop_scale_max=0.5, resized_crop_ratio_min=0.5,
             resized_crop_ratio_max=2.0, jitter_brightness=0.1, jitter_contrast=0.2, jitter_saturation=0.3,
             center_crop=10)
    data = build_dataset(cfg_for(tmp_path, "imagenet200", "iid", 2, client_test_fraction=0.0), o)
    t = data.transform
    assert t == ImageTransform(mean=IMAGENET_STATS[0], std=IMAGENET_STATS[1], flip=True, resized_crop=8,
                               resized_crop_scale=(0.25, 0.5), resized_crop_ratio=(0.5, 2.0), brightness=0.1,
                               contrast=0.2, saturation=0.3, center_crop=10)
    assert data.augments
    x = data.client(0).x[:5]
    assert t(x, True, torch.Generator().manual_seed(0)).shape == (5, 3, 8, 8)
    assert t(x, False).shape == (5, 3, 10, 10)
    # off by default: the dataset's transform is the one it always was
    plain = image_transform(opts("imagenet200"), IMAGENET_STATS)
    assert plain == ImageTransform(mean=IMAGENET_STATS[0], std=IMAGENET_STATS[1], crop_padding=8, flip=True)


def test_center_crop_larger_than_the_stored_images_is_refused(tmp_path):
    write_prepared(str(tmp_path), side=12)
    cfg = cfg_for(tmp_path, "imagenet200", "iid", 2, client_test_fraction=0.0)
    with pytest.raises(ConfigError, match=r"center_crop 13 is larger than the 12x12 images.*--size 256"):
        build_dataset(cfg, data_options(store="memory", center_crop=13))
    build_dataset(cfg, data_options(store="memory", center_crop=12)).close()


def test_pipeline_options_leave_the_client_store_alone(tmp_path):
    """They change how batches are fed, not what a store holds: one store serves every setting."""
    write_prepared(str(tmp_path), side=12)
    cfg = cfg_for(tmp_path, "imagenet200", "iid", 2, client_test_fraction=0.0)
    stores = str(tmp_path / "stores")
    build_dataset(cfg, opts("imagenet200", store="hdf5", store_dir=stores)).close()
    build_dataset(cfg, opts("imagenet200", store="hdf5", store_dir=stores, crop_padding=0, resized_crop=8,
                            jitter_brightness=0.4, center_crop=8)).close()
    assert len([f for f in os.listdir(stores) if f.endswith(".h5")]) == 1


AUTHORS = ImageTransform(mean=IMAGENET_STATS[0], std=IMAGENET_STATS[1], crop_padding=0, flip=True, resized_crop=224,
                         resized_crop_scale=(0.08, 1.0), resized_crop_ratio=(3 / 4, 4 / 3), brightness=0.4,
                         contrast=0.4, saturation=0.4, center_crop=224)


@pytest.mark.parametrize("name", IMAGENET_FILES)
def test_launch_files_run_the_authors_pipeline(name):
    path = os.path.join(LAUNCH_DIR, name)
    cfg, _, data_opts = parse_args(["--config", path])
    assert image_transform(data_opts, IMAGENET_STATS) == AUTHORS
    text = open(path).read()
    assert "--size 256" in text and "--size 64" in text
    # the header's quick 64-px variant: its flags give back the padded crop + flip at 64 px
    header = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    quick = shlex.split(header[header.index("Quick 64-px variant"):header.index("Client sampling row")])
    flags = [b.rstrip(".") for a, b in zip(quick, quick[1:]) if a == "--data-opt"]
    assert len(flags) == 6
    argv = ["--config", path] + [a for f in flags for a in ("--data-opt", f)]
    _, _, quick_opts = parse_args(argv)
    assert image_transform(quick_opts, IMAGENET_STATS) == ImageTransform(
        mean=IMAGENET_STATS[0], std=IMAGENET_STATS[1], crop_padding=8, flip=True)


def test_gradaug_file_resizes_to_the_authors_resolutions():
    path = os.path.join(LAUNCH_DIR, "fedalign_imagenet200_gradaug.yaml")
    _, algo_opts, _ = parse_args(["--config", path])
    crops = torch.zeros(1, 3, 224, 224)
    assert [resize(crops, s).shape[-1] for s in parse_scales(algo_opts.scales)] == [224, 192, 160, 128]
    _, quick, _ = parse_args(["--config", path, "--scales", "1.0,0.875,0.75,0.625"])
    assert [resize(torch.zeros(1, 3, 64, 64), s).shape[-1] for s in parse_scales(quick.scales)] == [64, 56, 48, 40]


def run_cropped(tmp_path, capsys, *argv, center_crop=8):
    """One short imagenet200 run on 12-px stored images with 8-px RandomResizedCrops."""
    from fedhpc.launch import main

    tmp_path.mkdir(exist_ok=True)
    write_prepared(str(tmp_path), side=12)
    out = tmp_path / "out"
    code = main(["--dataset", "imagenet200", "--data-dir", str(tmp_path), "--out", str(out), "--rounds", "1",
                 "--num-clients", "2", "--clients-per-round", "2", "--batch-size", "8", "--local-epochs", "1",
                 "--client-test-fraction", "0", "--quiet", "--threads", "1", "--no-tensorboard",
                 "--data-opt", "store=memory", "--data-opt", "crop_padding=0", "--data-opt", "resized_crop=8",
                 "--data-opt", f"center_crop={center_crop}", *argv])
    return code, capsys.readouterr().err, out


def test_models_are_built_for_the_cropped_inputs_not_the_stored_ones(tmp_path, capsys):
    """A model that flattens a fixed size (cnn) trains on 8-px crops of 12-px images: it must be
    built for 8x8 (building it for the stored 12x12 fails at the first batch)."""
    from fedhpc.models import build_model

    code, err, out = run_cropped(tmp_path, capsys, "--model", "cnn")
    assert code == 0, err
    saved = torch.load(out / "final_model.pt", map_location="cpu")
    built = build_model("cnn", (3, 8, 8), 4).state_dict()
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in built.items()}
    assert {k: v.shape for k, v in saved.items()} != {
        k: v.shape for k, v in build_model("cnn", (3, 12, 12), 4).state_dict().items()}


def test_evaluation_inputs_a_fixed_size_model_cannot_take_are_refused_before_any_round(tmp_path, capsys):
    code, err, out = run_cropped(tmp_path, capsys, "--model", "cnn", center_crop=0)
    assert code == 2, err
    assert "cannot take the evaluation inputs, 3x12x12" in err and "training inputs, 3x8x8" in err
    assert "--data-opt center_crop=8" in err and "Traceback" not in err
    assert not (out / "final_model.pt").exists()


def test_a_model_that_pools_adaptively_tests_at_the_larger_size(tmp_path, capsys):
    """FixRes-style: train on 8-px crops, test on whole 12-px images; mean data would mix the two
    sizes, so FedMix is refused with the same fix."""
    code, err, _ = run_cropped(tmp_path, capsys, "--model", "resnet_digits", center_crop=0)
    assert code == 0, err
    code, err, _ = run_cropped(tmp_path / "fedmix", capsys, "--model", "resnet_digits", "--algo", "fedmix",
                               center_crop=0)
    assert code == 2, err
    assert "mean data average evaluation-transformed inputs (3x12x12)" in err
    assert "training batches (3x8x8)" in err and "center_crop=8" in err
    # crops that agree: the mean table holds 8x8 means (it was sized for the stored 12x12)
    code, err, _ = run_cropped(tmp_path / "agree", capsys, "--model", "cnn", "--algo", "fedmix")
    assert code == 0, err


@pytest.mark.parametrize("split", ["train", "val"])
def test_labels_outside_the_classes_are_refused_in_either_split(tmp_path, split):
    write_prepared(str(tmp_path), side=12)
    with h5py.File(tmp_path / "imagenet200.h5", "a") as f:
        y = f[f"{split}/y"][()]
        y[0] = 4  # the file holds 4 classes
        f[f"{split}/y"][...] = y
    cfg = cfg_for(tmp_path, "imagenet200", "iid", 2, client_test_fraction=0.0)
    with pytest.raises(DataError, match=rf"\({split}/y\) has labels in \[0, 4\] but the dataset has 4 classes"):
        build_dataset(cfg, data_options(store="memory"))
