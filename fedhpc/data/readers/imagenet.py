"""Readers of the ImageNet subset prepared by ``python -m fedhpc.data.prepare imagenet200``."""

from __future__ import annotations

import os
from typing import List

import numpy as np

from ...errors import ConfigError, DataError
from ..formats import IMAGENET, missing, open_h5_readonly
from ..prepare import PREPARED_FORMAT
from .common import IMAGENET_STATS, Pool, Reader, check_labels, image_transform, register_reader, require_data_dir
from .options import Imagenet200Options


# --------------------------------------------------------------------------- ImageNet subset


class Imagenet200Reader(Reader):
    """The HDF5 file written by ``python -m fedhpc.data.prepare imagenet200``: train -> pool, val -> test."""

    name = "imagenet200"

    def __init__(self, cfg, opts):
        super().__init__(cfg, opts)
        f = opts.file
        if not os.path.isabs(f):
            f = os.path.join(opts.dir or require_data_dir(cfg, self.name, f), f)
        self.path = f
        self._h5 = None
        if not os.path.isfile(self.path):
            # the size the options need: the authors' 256 px under a centre crop, else the quick 64 px
            size = max(256, opts.center_crop) if opts.center_crop > 0 else 64
            raise missing(
                "prepared ImageNet subset", self.path,
                "HDF5 written by `python -m fedhpc.data.prepare imagenet200 --src <ImageNet dir> "
                f"--out {self.path} --size {size} --seed 0`", IMAGENET,
            )
        h5 = self._file()
        try:
            if h5.attrs.get("format") != PREPARED_FORMAT:
                raise KeyError("attribute format")
            self.num_classes = int(h5.attrs["num_classes"])
            self.x_tail = tuple(int(s) for s in h5["train/x"].shape[1:])
            for key in ("train/y", "val/x", "val/y"):
                h5[key]
        except KeyError as e:
            raise DataError(
                f"{self.path} is not a prepared image subset (missing {e}); write it with "
                f"`python -m fedhpc.data.prepare imagenet200 --src <ImageNet dir> --out {self.path}`"
            )
        try:
            opts.check_image_size(self.x_tail[-2], self.x_tail[-1], self.path)
        except ConfigError:
            self.close()
            raise

    def _file(self):
        if self._h5 is None:
            try:
                self._h5 = open_h5_readonly(self.path)
            except OSError as e:
                raise DataError(f"{self.path} cannot be opened as HDF5 ({e}); prepare it again")
        return self._h5

    def source_files(self) -> List[str]:
        return [self.path]

    def test_files(self) -> List[str]:
        return [f"{self.path} (val/)"]

    def estimate_bytes(self) -> int:
        ds = self._file()["train/x"]
        return int(np.prod(ds.shape)) * ds.dtype.itemsize + int(ds.shape[0]) * np.dtype(self.y_dtype).itemsize

    def load_pool(self, lazy: bool = False) -> Pool:
        f = self._file()
        y = f["train/y"][()].astype(np.int64)
        yt = f["val/y"][()].astype(np.int64)
        check_labels(y, self.num_classes, f"{self.path} (train/y)", IMAGENET)
        check_labels(yt, self.num_classes, f"{self.path} (val/y)", IMAGENET)  # else a wrong test accuracy
        x = f["train/x"] if lazy else f["train/x"][()]
        xt = f["val/x"] if lazy else f["val/x"][()]
        return Pool(x, y, xt, yt, y)

    def transform(self):
        return image_transform(self.opts, IMAGENET_STATS)

    def close(self) -> None:
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None


build_imagenet200 = register_reader(
    "imagenet200", Imagenet200Options, Imagenet200Reader,
    "200-class ImageNet subset prepared by `python -m fedhpc.data.prepare imagenet200`")
