"""What every reader shares: the reader base class, assembly into a federated dataset."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...errors import ConfigError, DataError
from ..augment import ImageTransform
from ..base import ArrayFederatedData, FederatedData
from ..formats import Published
from ..partition import make_partition, register_partition
from ..store import STORE_FORMAT, ArrayClients, StreamedClients, open_or_build_store, store_file_name, write_store
from .options import RUNTIME_ONLY_OPTIONS

#: model each dataset trains by default (``--model auto``), as in the papers fedhpc reproduces:
#: LeNet-5 for 28x28 characters, FedMix's VGG for CIFAR-10, FedAlign's ResNet-56 for CIFAR-100
#: and ResNet-18 for ImageNet-200, the 2-layer character LSTM for Shakespeare.
DEFAULT_MODELS = {
    "mnist": "lenet5", "fmnist": "lenet5", "emnist": "lenet5", "femnist": "lenet5",
    "cifar10": "vgg_fedmix", "cifar100": "resnet56", "cifar100_tff": "resnet56",
    "imagenet200": "resnet18", "shakespeare": "lstm_char",
}

#: a natural writer needs this many samples to have a training row after its local test split
MIN_CLIENT_SAMPLES = 2

# Per-channel mean / std of the training sets, in [0, 1] pixel units.
MNIST_STATS = ((0.1307,), (0.3081,))
FMNIST_STATS = ((0.2860,), (0.3530,))
EMNIST_STATS = ((0.1751,), (0.3332,))
CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))

#: LEAF's 80-character Shakespeare vocabulary; id = position. Other characters map to ' '.
SHAKESPEARE_VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
_CHAR_IDS = np.full(256, SHAKESPEARE_VOCAB.index(" "), dtype=np.uint8)
for _i, _ch in enumerate(SHAKESPEARE_VOCAB):
    _CHAR_IDS[ord(_ch)] = _i


@register_partition("natural", " (one client per writer; femnist, cifar100_tff, shakespeare)")
def _natural_needs_writers(labels, n, rng, arg):
    raise DataError(
        "partition 'natural' keeps each writer's data as one client, so it needs a naturally "
        "federated dataset (femnist, cifar100_tff, shakespeare); for this dataset use iid, "
        "dirichlet:ALPHA, dirichlet_capped:ALPHA, classes:K or skewed:M:A:B"
    )


# --------------------------------------------------------------------------- helpers


def require_data_dir(cfg, dataset: str, expected: str) -> str:
    data_dir = getattr(cfg, "data_dir", "") or ""
    if not data_dir:
        raise ConfigError(
            f"dataset {dataset!r} reads its files from --data-dir; pass --data-dir DIR, the folder "
            f"holding {expected}"
        )
    return data_dir


def resolve_partition(spec: Optional[str], natural: bool) -> str:
    spec = (spec or "").strip()
    if spec.lower() in ("", "auto", "default"):
        return "natural" if natural else "iid"
    if spec.lower() == "natural":
        return "natural"
    return spec


def encode_chars(text: str) -> np.ndarray:
    """Characters -> uint8 ids of :data:`SHAKESPEARE_VOCAB` (out-of-vocabulary -> ' ')."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    return _CHAR_IDS[np.minimum(points, 255)]


def char_sequences(ids: np.ndarray, seq_len: int) -> Tuple[np.ndarray, np.ndarray]:
    """Cut a character stream into non-overlapping windows: x = ids[kL:kL+L], y = ids[kL+1:kL+L+1]."""
    n = max((len(ids) - 1) // seq_len, 0)
    x = ids[: n * seq_len].reshape(n, seq_len)
    y = ids[1: n * seq_len + 1].reshape(n, seq_len)
    return x.copy(), y.copy()


#: how far outside [0, 1] a float pixel may lie (rounding of greyscale / 255) before the file is refused
PIXEL_TOLERANCE = 1e-6


def pixels_to_uint8(pixels: np.ndarray, invert: bool, where: str, published: Published) -> np.ndarray:
    """FEMNIST's float pixels (LEAF writes greyscale / 255, 1.0 = white; TFF's files derive from LEAF's)
    as uint8 0..255, inverted first with ``invert``.

    Values outside [0, 1] are refused, naming ``where``: clipping a 0..255 re-export (or another
    dataset's file) into [0, 1] would silently turn every image into black and white.
    """
    p = np.asarray(pixels, dtype=np.float32)
    if p.size:
        lo, hi = float(p.min()), float(p.max())  # NaN propagates, and fails both comparisons
        if not (lo >= -PIXEL_TOLERANCE and hi <= 1.0 + PIXEL_TOLERANCE):
            got = "NaN values" if math.isnan(lo) or math.isnan(hi) else f"values in [{lo:g}, {hi:g}]"
            raise DataError(
                f"{where} has pixel {got}; the pixels must be LEAF's greyscale floats in [0, 1] (value / 255, "
                f"1.0 = white), so the file is not in the published layout (a 0..255 re-export, or another "
                f"dataset's file): replace it with the published one ({published.where()})"
            )
    if invert:
        p = 1.0 - p
    return np.clip(np.rint(p * 255.0), 0, 255).astype(np.uint8)


def check_labels(y: np.ndarray, num_classes: int, where: str, published: Published) -> None:
    if y.size and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise DataError(
            f"{where} has labels in [{int(y.min())}, {int(y.max())}] but the dataset has {num_classes} "
            f"classes; the file is corrupt or from another dataset ({published.where()})"
        )


def fingerprint(paths: List[str]) -> List[List[Any]]:
    """(name, size, mtime) of every source file: a store is rebuilt when its sources change."""
    out = []
    for p in sorted(paths):
        st = os.stat(p)
        out.append([os.path.basename(p), int(st.st_size), int(st.st_mtime_ns)])
    return out


def image_transform(opts, stats) -> ImageTransform:
    mean, std = stats if opts.normalize else (None, None)
    # the resized crop, jitter and centre crop are options of some datasets only (imagenet200)
    extra = {}
    if getattr(opts, "resized_crop", 0) > 0:
        extra.update(resized_crop=opts.resized_crop,
                     resized_crop_scale=(opts.resized_crop_scale_min, opts.resized_crop_scale_max),
                     resized_crop_ratio=(opts.resized_crop_ratio_min, opts.resized_crop_ratio_max))
    for key in ("brightness", "contrast", "saturation"):
        extra[key] = getattr(opts, f"jitter_{key}", 0.0)
    extra["center_crop"] = getattr(opts, "center_crop", 0)
    return ImageTransform(mean=mean, std=std, crop_padding=opts.crop_padding, flip=opts.flip, **extra)


# --------------------------------------------------------------------------- reader base


@dataclass
class Pool:
    """A dataset's training pool and global test set, before the partition."""

    x: Any  # (N, ...) numpy array, or an h5py dataset when only a store is built from it
    y: np.ndarray
    x_test: Any
    y_test: np.ndarray
    #: one label per sample for synthetic partitions (the targets for classification)
    part_labels: np.ndarray


class Reader:
    """What one dataset knows: where its files are, how to load them, how to feed them."""

    name = ""
    natural = False
    task = "classification"
    num_classes = 0
    x_tail: Tuple[int, ...] = ()
    x_dtype = np.uint8
    y_tail: Tuple[int, ...] = ()
    y_dtype = np.int64

    def __init__(self, cfg, opts):
        self.cfg, self.opts = cfg, opts

    @property
    def default_model(self) -> str:
        return DEFAULT_MODELS.get(self.name, "cnn")

    # to implement
    def source_files(self) -> List[str]:
        raise NotImplementedError

    def estimate_bytes(self) -> int:
        """Bytes of the training pool once loaded, x and y: store=auto compares it with store_threshold_mb."""
        raise NotImplementedError

    def load_pool(self, lazy: bool = False) -> Pool:
        raise NotImplementedError

    def transform(self):
        raise NotImplementedError

    def close(self) -> None:
        pass

    def test_files(self) -> List[str]:
        """The files the global test set is read from (named when it is empty)."""
        return self.source_files()

    #: why a test file with samples can still give an empty test set (said in that error)
    empty_test_hint = ""

    # shared
    def require_test(self, n: int) -> None:
        """Refuse an empty global test set: evaluation would report accuracy 0 over no samples."""
        if n == 0:
            raise DataError(
                f"the global test set of {self.name} is empty: {', '.join(self.test_files())} hold(s) no test "
                f"samples{self.empty_test_hint}, and every test accuracy of the run would read 0; replace the "
                f"test file(s) with the published ones, which hold the dataset's test split"
            )

    def content_options(self) -> Dict[str, Any]:
        return {f.name: getattr(self.opts, f.name) for f in fields(self.opts)
                if f.name not in RUNTIME_ONLY_OPTIONS}

    def partition(self, spec: str, labels: np.ndarray) -> List[np.ndarray]:
        return make_partition(spec, labels, self.cfg.num_clients, self.cfg.seed, min_samples=MIN_CLIENT_SAMPLES)

    def memory_data(self, spec: str) -> Tuple[Any, ...]:
        """(x_pool, y_pool, x_test, y_test, partition) as numpy arrays for ArrayFederatedData."""
        pool = self.load_pool(lazy=False)
        self.require_test(len(pool.y_test))
        return pool.x, pool.y, pool.x_test, pool.y_test, self.partition(spec, pool.part_labels)

    def store_sources(self, spec: str):
        """(client source, global test source) for :func:`write_store`."""
        pool = self.load_pool(lazy=True)
        self.require_test(len(pool.y_test))
        parts = self.partition(spec, pool.part_labels)
        return ArrayClients(pool.x, pool.y, parts), ArrayClients.blocks(pool.x_test, pool.y_test)


class NaturalReader(Reader):
    """A dataset whose clients are its writers: lists them cheaply and loads them one by one."""

    natural = True

    def writer_counts(self) -> np.ndarray:
        raise NotImplementedError

    def load_writer(self, k: int) -> Tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def test_source(self):
        raise NotImplementedError

    def writer_labels(self, y: np.ndarray) -> np.ndarray:
        return y

    def estimate_bytes(self) -> int:
        # y counts too: Shakespeare's y is a sequence as long as x, half of the pool
        per_sample = (int(np.prod(self.x_tail)) * np.dtype(self.x_dtype).itemsize
                      + int(np.prod(self.y_tail)) * np.dtype(self.y_dtype).itemsize)
        return int(self.writer_counts().sum()) * per_sample

    def chosen_writers(self) -> np.ndarray:
        """Writers that become clients 0..num_clients-1 (seeded draw among the eligible, sorted)."""
        counts = self.writer_counts()
        eligible = np.flatnonzero(counts >= MIN_CLIENT_SAMPLES)
        n = int(self.cfg.num_clients)
        if len(eligible) == 0:
            # no --num-clients can help: the files themselves hold no usable writer
            test = set(self.test_files())
            train = [f for f in self.source_files() if f not in test]
            named = ", ".join(train[:3]) + (f" and {len(train) - 3} more" if len(train) > 3 else "")
            raise DataError(
                f"{self.name} has no writer with at least {MIN_CLIENT_SAMPLES} samples ({len(counts)} writer(s), "
                f"{int(counts.max()) if len(counts) else 0} sample(s) at most, in {named}), so partition 'natural' "
                f"has no client to give; check that the files under --data-dir are the complete published "
                f"{self.name} training files, not a truncated or filtered copy, or pool the samples with another "
                f"partition (e.g. --partition iid)"
            )
        if n > len(eligible):
            raise DataError(
                f"{self.name} has {len(eligible)} writers with at least {MIN_CLIENT_SAMPLES} samples, "
                f"so partition 'natural' cannot give {n} clients; use --num-clients {len(eligible)} "
                f"(all writers) or fewer"
            )
        if n == len(eligible):
            return eligible
        rng = np.random.default_rng([int(self.cfg.seed), 0x57A7E])
        return np.sort(rng.choice(eligible, size=n, replace=False))

    def checked_test_source(self):
        src = self.test_source()
        self.require_test(int(np.sum(src.counts)))
        return src

    def _test_arrays(self):
        src = self.checked_test_source()
        parts = [src.load(k) for k in range(len(src.counts))]
        x = np.concatenate([p[0] for p in parts]) if parts else np.empty((0,) + self.x_tail, self.x_dtype)
        y = np.concatenate([p[1] for p in parts]) if parts else np.empty((0,) + self.y_tail, self.y_dtype)
        return x, y

    def load_pool(self, lazy: bool = False) -> Pool:
        parts = [self.load_writer(k) for k in range(len(self.writer_counts()))]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        x_test, y_test = self._test_arrays()
        return Pool(x, y, x_test, y_test, self.writer_labels(y))

    def memory_data(self, spec: str):
        if spec != "natural":
            return super().memory_data(spec)
        chosen = self.chosen_writers()
        parts = [self.load_writer(int(k)) for k in chosen]
        x = np.concatenate([p[0] for p in parts])
        y = np.concatenate([p[1] for p in parts])
        bounds = np.concatenate([[0], np.cumsum([len(p[1]) for p in parts])])
        partition = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        x_test, y_test = self._test_arrays()
        return x, y, x_test, y_test, partition

    def store_sources(self, spec: str):
        if spec != "natural":
            return super().store_sources(spec)
        chosen = self.chosen_writers()
        counts = self.writer_counts()[chosen]
        clients = StreamedClients(counts, lambda k: self.load_writer(int(chosen[k])),
                                  self.x_tail, self.x_dtype, self.y_tail, self.y_dtype)
        return clients, self.checked_test_source()


# --------------------------------------------------------------------------- assembly


def assemble(reader: Reader) -> FederatedData:
    """Partition a reader's data and hand it out from memory or from a per-client store."""
    cfg, opts = reader.cfg, reader.opts
    spec = resolve_partition(getattr(cfg, "partition", None), reader.natural)
    try:
        sources = reader.source_files()
        mode = opts.store
        if mode == "auto":
            mode = "hdf5" if reader.estimate_bytes() > opts.store_threshold_mb * 2 ** 20 else "memory"
        if mode == "memory":
            x, y, x_test, y_test, parts = reader.memory_data(spec)
            return ArrayFederatedData(
                reader.name, x, y, x_test, y_test, parts, num_classes=reader.num_classes,
                client_test_fraction=cfg.client_test_fraction, seed=cfg.seed,
                transform=reader.transform(), default_model=reader.default_model, task=reader.task,
            )
        meta = {
            "format": STORE_FORMAT, "dataset": reader.name, "partition": spec,
            "num_clients": int(cfg.num_clients), "seed": int(cfg.seed),
            "client_test_fraction": float(cfg.client_test_fraction),
            "options": reader.content_options(), "sources": fingerprint(sources),
        }
        store_dir = opts.store_dir or os.path.join(cfg.data_dir, "fedhpc_stores")
        path = os.path.join(store_dir, store_file_name(meta))

        def build(tmp: str) -> None:
            clients, test = reader.store_sources(spec)
            write_store(
                tmp, clients, test, meta=meta, name=reader.name, num_classes=reader.num_classes,
                task=reader.task, default_model=reader.default_model,
                client_test_fraction=cfg.client_test_fraction, seed=cfg.seed,
                progress=sys.stderr.isatty(),
            )

        return open_or_build_store(path, meta, build, reader.transform())
    finally:
        reader.close()


def checked_options(options, cls):
    opts = options if options is not None else cls()
    if not isinstance(opts, cls):
        raise ConfigError(f"expected {cls.__name__} options, got {type(opts).__name__}")
    opts.validate()
    return opts


def register_reader(name: str, options_cls, reader_cls, help: str):
    """Registers dataset ``name`` whose builder is ``reader_cls`` over checked options, assembled;
    returns the builder (``build_<name>``)."""
    from .. import register_dataset

    def build(cfg, options=None) -> FederatedData:
        return assemble(reader_cls(cfg, checked_options(options, options_cls)))

    build.__name__ = build.__qualname__ = f"build_{name}"
    return register_dataset(name, options_cls, help)(build)
