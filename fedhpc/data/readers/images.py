"""Readers of IDX (MNIST family) and CIFAR datasets."""

from __future__ import annotations

import os
from typing import List, Tuple

import numpy as np

from ..formats import (
    CIFAR10, CIFAR100, EMNIST, FASHION_MNIST, MNIST, Published, find_idx, missing, read_cifar10,
    read_cifar100, read_idx_header, read_idx_images_labels,
)
from .common import (
    CIFAR100_STATS, CIFAR10_STATS, EMNIST_STATS, FMNIST_STATS, MNIST_STATS, Pool, Reader, check_labels,
    image_transform, register_reader, require_data_dir,
)
from .options import EMNIST_CLASSES, Cifar100Options, Cifar10Options, EmnistOptions, FmnistOptions, MnistOptions


# --------------------------------------------------------------------------- IDX datasets


class IdxReader(Reader):
    published: Published = MNIST
    subdir = "MNIST/raw"
    files = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    stats = MNIST_STATS
    num_classes = 10
    x_tail = (1, 28, 28)

    def root(self) -> str:
        if self.opts.dir:
            return self.opts.dir
        data_dir = require_data_dir(self.cfg, self.name, f"{self.subdir}/{self.files[0]}[.gz]")
        return os.path.join(data_dir, self.subdir)

    def source_files(self) -> List[str]:
        return [find_idx(self.root(), stem, f"{self.published.title} {stem}", self.published) for stem in self.files]

    def test_files(self) -> List[str]:
        return self.source_files()[2:]

    def estimate_bytes(self) -> int:
        dims, dtype = read_idx_header(self.source_files()[0], self.published)
        return int(np.prod(dims)) * dtype.itemsize + int(dims[0]) * np.dtype(self.y_dtype).itemsize

    def fix(self, x: np.ndarray, y: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        return x, y

    def load_pool(self, lazy: bool = False) -> Pool:
        root = self.root()
        what = self.published.title
        x, y = read_idx_images_labels(root, self.files[0], self.files[1], f"{what} training", self.published)
        xt, yt = read_idx_images_labels(root, self.files[2], self.files[3], f"{what} test", self.published)
        x, y = self.fix(x, y)
        xt, yt = self.fix(xt, yt)
        check_labels(y, self.num_classes, os.path.join(root, self.files[1]), self.published)
        check_labels(yt, self.num_classes, os.path.join(root, self.files[3]), self.published)
        self.x_tail = (1,) + x.shape[1:]
        return Pool(x[:, None], y, xt[:, None], yt, y)

    def transform(self):
        return image_transform(self.opts, self.stats)


class MnistReader(IdxReader):
    name = "mnist"


class FmnistReader(IdxReader):
    name = "fmnist"
    published = FASHION_MNIST
    subdir = "FashionMNIST/raw"
    stats = FMNIST_STATS


class EmnistReader(IdxReader):
    name = "emnist"
    published = EMNIST
    subdir = "EMNIST/raw"
    stats = EMNIST_STATS

    def __init__(self, cfg, opts):
        super().__init__(cfg, opts)
        s = opts.split
        self.files = (f"emnist-{s}-train-images-idx3-ubyte", f"emnist-{s}-train-labels-idx1-ubyte",
                      f"emnist-{s}-test-images-idx3-ubyte", f"emnist-{s}-test-labels-idx1-ubyte")
        self.num_classes = EMNIST_CLASSES[s]

    def fix(self, x, y):
        # EMNIST's IDX images are stored transposed (column-major); letters are labelled 1..26.
        x = np.ascontiguousarray(x.transpose(0, 2, 1))
        if self.opts.split == "letters":
            y = y - 1
        return x, y


build_mnist = register_reader("mnist", MnistOptions, MnistReader,
                              "MNIST from IDX files (<data_dir>/MNIST/raw), 28x28, 10 classes")
build_fmnist = register_reader("fmnist", FmnistOptions, FmnistReader,
                               "Fashion-MNIST from IDX files (<data_dir>/FashionMNIST/raw), 10 classes")
build_emnist = register_reader("emnist", EmnistOptions, EmnistReader,
                               "EMNIST from IDX files (<data_dir>/EMNIST/raw); option split")


# --------------------------------------------------------------------------- CIFAR


class CifarReader(Reader):
    name = "cifar10"
    subdir = "cifar-10-batches-py"
    published = CIFAR10
    files = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
    num_classes = 10
    stats = CIFAR10_STATS
    x_tail = (3, 32, 32)

    def root(self) -> str:
        if self.opts.dir:
            return self.opts.dir
        return os.path.join(require_data_dir(self.cfg, self.name, self.subdir + "/"), self.subdir)

    def source_files(self) -> List[str]:
        paths = [os.path.join(self.root(), f) for f in self.files]
        for p in paths:
            if not os.path.isfile(p):
                raise missing(f"{self.published.title} batch", p, "python version: " + ", ".join(self.files),
                              self.published, "extract the python version archive into --data-dir")
        return paths

    def test_files(self) -> List[str]:
        return self.source_files()[-1:]

    def estimate_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.source_files()[:-1])

    def read(self):
        return read_cifar10(self.root())

    def load_pool(self, lazy: bool = False) -> Pool:
        x, y, xt, yt = self.read()
        check_labels(y, self.num_classes, self.root(), self.published)
        check_labels(yt, self.num_classes, self.root(), self.published)
        return Pool(x, y, xt, yt, y)

    def transform(self):
        return image_transform(self.opts, self.stats)


class Cifar100Reader(CifarReader):
    name = "cifar100"
    subdir = "cifar-100-python"
    published = CIFAR100
    files = ("train", "test")
    stats = CIFAR100_STATS

    def __init__(self, cfg, opts):
        super().__init__(cfg, opts)
        self.num_classes = 20 if opts.coarse else 100

    def read(self):
        return read_cifar100(self.root(), "coarse" if self.opts.coarse else "fine")


build_cifar10 = register_reader("cifar10", Cifar10Options, CifarReader,
                                "CIFAR-10 python pickles (<data_dir>/cifar-10-batches-py), 32x32x3")
build_cifar100 = register_reader("cifar100", Cifar100Options, Cifar100Reader,
                                 "CIFAR-100 python pickles (<data_dir>/cifar-100-python); option coarse")
