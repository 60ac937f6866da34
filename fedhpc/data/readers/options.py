"""The datasets' options (``--data-opt KEY=VALUE``), one dataclass per dataset, validated when set."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import ConfigError


@dataclass
class StoreOptions:
    #: where clients live during the run: auto | memory | hdf5 (per-client store read lazily)
    store: str = "auto"
    #: folder for built client stores (default <data_dir>/fedhpc_stores); must be writable once
    store_dir: str = ""
    #: store=auto uses hdf5 when the training pool is larger than this many MiB
    store_threshold_mb: float = 256.0
    #: folder holding the dataset's files (default: a dataset-specific folder under --data-dir)
    dir: str = ""

    def validate(self):
        if self.store not in ("auto", "memory", "hdf5"):
            raise ConfigError(f"data option store must be auto, memory or hdf5, got {self.store!r}")
        if not self.store_threshold_mb >= 0:
            raise ConfigError(f"data option store_threshold_mb must be >= 0, got {self.store_threshold_mb}")
        crop = getattr(self, "crop_padding", 0)
        if crop < 0:
            raise ConfigError(f"data option crop_padding must be >= 0 (0 = no random crop), got {crop}")


#: options that change only how data is fed, not what a store holds
RUNTIME_ONLY_OPTIONS = {"store", "store_dir", "store_threshold_mb", "dir", "normalize", "crop_padding", "flip",
                         "resized_crop", "resized_crop_scale_min", "resized_crop_scale_max",
                         "resized_crop_ratio_min", "resized_crop_ratio_max", "jitter_brightness",
                         "jitter_contrast", "jitter_saturation", "center_crop"}


@dataclass
class MnistOptions(StoreOptions):
    #: subtract the training mean / divide by the std per channel
    normalize: bool = True
    #: random-crop padding in pixels on training batches (0 = off)
    crop_padding: int = 0
    #: random horizontal flips on training batches
    flip: bool = False


@dataclass
class FmnistOptions(MnistOptions):
    pass


EMNIST_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}


@dataclass
class EmnistOptions(MnistOptions):
    #: byclass | bymerge | balanced | letters | digits | mnist
    split: str = "balanced"

    def validate(self):
        super().validate()
        if self.split not in EMNIST_CLASSES:
            raise ConfigError(f"emnist split must be one of {sorted(EMNIST_CLASSES)}, got {self.split!r}")


@dataclass
class Cifar10Options(MnistOptions):
    crop_padding: int = 4
    flip: bool = True


@dataclass
class Cifar100Options(Cifar10Options):
    #: use the 20 coarse superclasses instead of the 100 fine labels
    coarse: bool = False


@dataclass
class FemnistOptions(MnistOptions):
    #: auto (TFF HDF5 if present, else LEAF JSON) | tff | leaf
    source: str = "auto"
    #: TFF's digits-only files (fed_emnist_digitsonly_*.h5, 10 classes)
    only_digits: bool = False
    #: TFF and LEAF store white background (1.0) and dark ink; invert to MNIST's convention
    invert: bool = True
    #: FEMNIST is usually fed as raw [0, 1] pixels
    normalize: bool = False

    def validate(self):
        super().validate()
        if self.source not in ("auto", "tff", "leaf"):
            raise ConfigError(f"femnist source must be auto, tff or leaf, got {self.source!r}")
        if self.only_digits and self.source == "leaf":
            raise ConfigError("femnist only_digits reads TFF's digits-only files; use source=tff or auto")


@dataclass
class Cifar100TffOptions(Cifar100Options):
    pass


@dataclass
class ShakespeareOptions(StoreOptions):
    #: auto (TFF HDF5 if present, else LEAF JSON) | tff | leaf
    source: str = "auto"
    #: characters per input sequence; targets are the next character at every position
    seq_len: int = 80

    def validate(self):
        super().validate()
        if self.source not in ("auto", "tff", "leaf"):
            raise ConfigError(f"shakespeare source must be auto, tff or leaf, got {self.source!r}")
        if self.seq_len < 1:
            raise ConfigError(f"shakespeare seq_len must be positive, got {self.seq_len}")


@dataclass
class Imagenet200Options(Cifar10Options):
    #: the HDF5 written by `python -m fedhpc.data.prepare imagenet200` (relative to --data-dir)
    file: str = "imagenet200.h5"
    crop_padding: int = 8
    #: RandomResizedCrop on training batches: output side in pixels (0 = off; needs crop_padding 0)
    resized_crop: int = 0
    #: range of the crop's area, as a fraction of the stored image's (RandomResizedCrop's scale)
    resized_crop_scale_min: float = 0.08
    resized_crop_scale_max: float = 1.0
    #: range of the crop's aspect ratio width / height, drawn log-uniformly (RandomResizedCrop's ratio)
    resized_crop_ratio_min: float = 3.0 / 4.0
    resized_crop_ratio_max: float = 4.0 / 3.0
    #: colour jitter of training batches (ColorJitter): per image a factor in [max(0, 1 - s), 1 + s] (0 = off)
    jitter_brightness: float = 0.0
    jitter_contrast: float = 0.0
    jitter_saturation: float = 0.0
    #: evaluation batches: the central square of this side in pixels (0 = off; CenterCrop)
    center_crop: int = 0

    def validate(self):
        super().validate()
        for name in ("resized_crop", "center_crop"):
            if getattr(self, name) < 0:
                raise ConfigError(f"data option {name} must be >= 0 pixels (0 = off), got {getattr(self, name)}")
        if self.resized_crop > 0 and self.crop_padding > 0:
            raise ConfigError(
                f"data options resized_crop {self.resized_crop} and crop_padding {self.crop_padding} are two random "
                f"crops; RandomResizedCrop replaces the padded crop: set crop_padding: 0 (or resized_crop: 0)")
        lo, hi = self.resized_crop_scale_min, self.resized_crop_scale_max
        if not 0 < lo <= hi <= 1:
            raise ConfigError(
                f"data options resized_crop_scale_min / _max are fractions of the image's area with "
                f"0 < min <= max <= 1, got {lo} and {hi} (torchvision's default: 0.08 and 1.0)")
        lo, hi = self.resized_crop_ratio_min, self.resized_crop_ratio_max
        if not (0 < lo <= hi and math.isfinite(hi)):
            raise ConfigError(
                f"data options resized_crop_ratio_min / _max are aspect ratios (width / height) with "
                f"0 < min <= max, got {lo} and {hi} (torchvision's default: 0.75 and 1.3333333333333333)")
        for name in ("jitter_brightness", "jitter_contrast", "jitter_saturation"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"data option {name} is a jitter strength s >= 0 (factors in "
                                  f"[max(0, 1 - s), 1 + s]; 0 = off), got {v}")

    def check_image_size(self, height: int, width: int, where: str) -> None:
        """Refuse a centre crop larger than the stored images (known once the file is open)."""
        if self.center_crop > min(height, width):
            raise ConfigError(
                f"data option center_crop {self.center_crop} is larger than the {height}x{width} images of "
                f"{where}; prepare the file at a larger --size (e.g. --size 256 for center_crop 224) or lower "
                f"center_crop (0 = off)")
