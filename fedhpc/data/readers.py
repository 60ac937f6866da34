"""Real datasets, read from the files users already have in their published formats.

Nothing is downloaded: each dataset looks under ``--data-dir`` (or its ``dir``
option) for the files as they are distributed, and a missing or malformed file
stops the run with a :class:`DataError` naming the expected path, its layout and
where the dataset is published.

Registered datasets (``--dataset NAME``, options via ``--data-opt k=v``):

==============  =====================================================================
mnist           IDX files, <data_dir>/MNIST/raw/
fmnist          IDX files, <data_dir>/FashionMNIST/raw/
emnist          IDX files, <data_dir>/EMNIST/raw/emnist-<split>-...; option split
cifar10         python pickles, <data_dir>/cifar-10-batches-py/
cifar100        python pickles, <data_dir>/cifar-100-python/; option coarse
femnist         natural: TFF HDF5 (fed_emnist_*.h5) or LEAF JSON, <data_dir>/femnist/
cifar100_tff    natural: TFF HDF5 (fed_cifar100_*.h5), <data_dir>/cifar100_tff/
shakespeare     natural: TFF HDF5 (shakespeare_*.h5) or LEAF JSON, <data_dir>/shakespeare/
imagenet200     HDF5 written by ``python -m fedhpc.data.prepare imagenet200``
==============  =====================================================================

Partitions: every dataset takes the synthetic partitions (iid, dirichlet:A,
classes:K, skewed:M:A:B / mix2fld). The naturally federated ones also take
``natural`` (one client per writer / speaking role); an empty, ``auto`` or
``default`` partition means ``natural`` for them and ``iid`` for the others.
Synthetic partitions on a natural dataset pool all writers first.

With ``natural``, ``num_clients`` writers are chosen by a seeded draw among the
writers with at least two samples (all of them when ``num_clients`` equals that
number); asking for more writers than exist is an error. Each client's local
test split is ``client_test_fraction`` of its own training rows (as for every
other dataset); the published test file is the global test set.

Storage: ``store=memory`` keeps the pool in RAM (:class:`ArrayFederatedData`);
``store=hdf5`` builds a per-client HDF5 store once (under ``store_dir``, default
``<data_dir>/fedhpc_stores``) and reads only the clients a rank trains;
``store=auto`` (default) picks hdf5 when the training pool exceeds
``store_threshold_mb``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..errors import ConfigError, DataError
from . import register_dataset
from .augment import ImageTransform, token_ids
from .base import ArrayFederatedData, FederatedData
from .formats import (
    CIFAR10, CIFAR100, EMNIST, FASHION_MNIST, IMAGENET, LEAF_FEMNIST, LEAF_SHAKESPEARE, MNIST,
    TFF_CIFAR100, TFF_EMNIST, TFF_EMNIST_DIGITS, TFF_SHAKESPEARE, Published, TFFClientFile,
    decode_strings, find_idx, iter_leaf_users, leaf_json_files, missing, open_h5_readonly, read_cifar10,
    read_cifar100, read_idx_header, read_idx_images_labels,
)
from .partition import make_partition, register_partition
from .prepare import PREPARED_FORMAT
from .store import (
    STORE_FORMAT, ArrayClients, StreamedClients, open_or_build_store, store_file_name, write_store,
)

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
        "dirichlet:ALPHA, classes:K or skewed:M:A:B"
    )


# --------------------------------------------------------------------------- options


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
_RUNTIME_ONLY_OPTIONS = {"store", "store_dir", "store_threshold_mb", "dir", "normalize", "crop_padding", "flip"}


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


_EMNIST_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}


@dataclass
class EmnistOptions(MnistOptions):
    #: byclass | bymerge | balanced | letters | digits | mnist
    split: str = "balanced"

    def validate(self):
        super().validate()
        if self.split not in _EMNIST_CLASSES:
            raise ConfigError(f"emnist split must be one of {sorted(_EMNIST_CLASSES)}, got {self.split!r}")


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


def pixels_to_uint8(pixels: np.ndarray, invert: bool) -> np.ndarray:
    p = np.asarray(pixels, dtype=np.float32)
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
    return ImageTransform(mean=mean, std=std, crop_padding=opts.crop_padding, flip=opts.flip)


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
        raise NotImplementedError

    def load_pool(self, lazy: bool = False) -> Pool:
        raise NotImplementedError

    def transform(self):
        raise NotImplementedError

    def close(self) -> None:
        pass

    # shared
    def content_options(self) -> Dict[str, Any]:
        return {f.name: getattr(self.opts, f.name) for f in fields(self.opts)
                if f.name not in _RUNTIME_ONLY_OPTIONS}

    def partition(self, spec: str, labels: np.ndarray) -> List[np.ndarray]:
        return make_partition(spec, labels, self.cfg.num_clients, self.cfg.seed, min_samples=MIN_CLIENT_SAMPLES)

    def memory_data(self, spec: str) -> Tuple[Any, ...]:
        """(x_pool, y_pool, x_test, y_test, partition) as numpy arrays for ArrayFederatedData."""
        pool = self.load_pool(lazy=False)
        return pool.x, pool.y, pool.x_test, pool.y_test, self.partition(spec, pool.part_labels)

    def store_sources(self, spec: str):
        """(client source, global test source) for :func:`write_store`."""
        pool = self.load_pool(lazy=True)
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
        per_sample = int(np.prod(self.x_tail)) * np.dtype(self.x_dtype).itemsize
        return int(self.writer_counts().sum()) * per_sample

    def chosen_writers(self) -> np.ndarray:
        """Writers that become clients 0..num_clients-1 (seeded draw among the eligible, sorted)."""
        counts = self.writer_counts()
        eligible = np.flatnonzero(counts >= MIN_CLIENT_SAMPLES)
        n = int(self.cfg.num_clients)
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

    def _test_arrays(self):
        src = self.test_source()
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
        return clients, self.test_source()


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


def _opts(options, cls):
    opts = options if options is not None else cls()
    if not isinstance(opts, cls):
        raise ConfigError(f"expected {cls.__name__} options, got {type(opts).__name__}")
    opts.validate()
    return opts


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

    def estimate_bytes(self) -> int:
        dims, dtype = read_idx_header(self.source_files()[0], self.published)
        return int(np.prod(dims)) * dtype.itemsize

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
        self.num_classes = _EMNIST_CLASSES[s]

    def fix(self, x, y):
        # EMNIST's IDX images are stored transposed (column-major); letters are labelled 1..26.
        x = np.ascontiguousarray(x.transpose(0, 2, 1))
        if self.opts.split == "letters":
            y = y - 1
        return x, y


@register_dataset("mnist", MnistOptions, "MNIST from IDX files (<data_dir>/MNIST/raw), 28x28, 10 classes")
def build_mnist(cfg, options: MnistOptions = None):
    return assemble(MnistReader(cfg, _opts(options, MnistOptions)))


@register_dataset("fmnist", FmnistOptions, "Fashion-MNIST from IDX files (<data_dir>/FashionMNIST/raw), 10 classes")
def build_fmnist(cfg, options: FmnistOptions = None):
    return assemble(FmnistReader(cfg, _opts(options, FmnistOptions)))


@register_dataset("emnist", EmnistOptions, "EMNIST from IDX files (<data_dir>/EMNIST/raw); option split")
def build_emnist(cfg, options: EmnistOptions = None):
    return assemble(EmnistReader(cfg, _opts(options, EmnistOptions)))


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


@register_dataset("cifar10", Cifar10Options, "CIFAR-10 python pickles (<data_dir>/cifar-10-batches-py), 32x32x3")
def build_cifar10(cfg, options: Cifar10Options = None):
    return assemble(CifarReader(cfg, _opts(options, Cifar10Options)))


@register_dataset("cifar100", Cifar100Options, "CIFAR-100 python pickles (<data_dir>/cifar-100-python); option coarse")
def build_cifar100(cfg, options: Cifar100Options = None):
    return assemble(Cifar100Reader(cfg, _opts(options, Cifar100Options)))


# --------------------------------------------------------------------------- natural datasets


class TFFNaturalReader(NaturalReader):
    """Writers are the clients of a TFF HDF5 train file; the test file is the global test set."""

    train_name = test_name = ""
    tff_fields: Tuple[str, ...] = ()
    tff_published: Published = TFF_EMNIST

    def __init__(self, cfg, opts, root: str):
        super().__init__(cfg, opts)
        self.root = root
        self.train = TFFClientFile(os.path.join(root, self.train_name), self.tff_fields, self.tff_published,
                                   f"{self.tff_published.title} training file")
        self.test = TFFClientFile(os.path.join(root, self.test_name), self.tff_fields, self.tff_published,
                                  f"{self.tff_published.title} test file")
        self._counts: Optional[np.ndarray] = None

    def source_files(self) -> List[str]:
        return [self.train.path, self.test.path]

    def writer_counts(self) -> np.ndarray:
        if self._counts is None:
            self._counts = np.array([self.train.num_examples(c) for c in self.train.client_ids()], dtype=np.int64)
        return self._counts

    def convert(self, arrays: Dict[str, np.ndarray], where: str) -> Tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def load_writer(self, k: int):
        cid = self.train.client_ids()[k]
        return self.convert(self.train.read_client(cid), f"{self.train.path} client {cid!r}")

    def test_source(self):
        ids = self.test.client_ids()
        counts = [self.test.num_examples(c) for c in ids]

        def load(k):
            return self.convert(self.test.read_client(ids[k]), f"{self.test.path} client {ids[k]!r}")

        return StreamedClients(counts, load, self.x_tail, self.x_dtype, self.y_tail, self.y_dtype)

    def close(self) -> None:
        self.train.close()
        self.test.close()


def _shape_error(where: str, what: str, got, fed: Published) -> DataError:
    return DataError(f"{where}: expected {what}, got {got}; the file is not in the published layout ({fed.where()})")


class FemnistTFF(TFFNaturalReader):
    name = "femnist"
    tff_fields = ("pixels", "label")
    x_tail = (1, 28, 28)

    def __init__(self, cfg, opts, root):
        digits = opts.only_digits
        self.train_name = "fed_emnist_digitsonly_train.h5" if digits else "fed_emnist_train.h5"
        self.test_name = "fed_emnist_digitsonly_test.h5" if digits else "fed_emnist_test.h5"
        self.tff_published = TFF_EMNIST_DIGITS if digits else TFF_EMNIST
        self.num_classes = 10 if digits else 62
        super().__init__(cfg, opts, root)

    def convert(self, a, where):
        p, y = a["pixels"], np.asarray(a["label"]).astype(np.int64)
        if p.ndim != 3 or p.shape[1:] != (28, 28):
            raise _shape_error(where, "pixels of shape (n, 28, 28)", p.shape, self.tff_published)
        check_labels(y, self.num_classes, where, self.tff_published)
        return pixels_to_uint8(p, self.opts.invert)[:, None], y

    def transform(self):
        return image_transform(self.opts, EMNIST_STATS)


class Cifar100TFF(TFFNaturalReader):
    name = "cifar100_tff"
    train_name, test_name = "fed_cifar100_train.h5", "fed_cifar100_test.h5"
    tff_published = TFF_CIFAR100
    x_tail = (3, 32, 32)

    def __init__(self, cfg, opts, root):
        self.num_classes = 20 if opts.coarse else 100
        self.tff_fields = ("image", "coarse_label" if opts.coarse else "label")
        super().__init__(cfg, opts, root)

    def convert(self, a, where):
        img, y = a["image"], np.asarray(a[self.tff_fields[1]]).astype(np.int64)
        if img.ndim != 4 or img.shape[1:] != (32, 32, 3) or img.dtype != np.uint8:
            raise _shape_error(where, "uint8 images of shape (n, 32, 32, 3)", f"{img.dtype} {img.shape}",
                               self.tff_published)
        check_labels(y, self.num_classes, where, self.tff_published)
        return np.ascontiguousarray(img.transpose(0, 3, 1, 2)), y

    def transform(self):
        return image_transform(self.opts, CIFAR100_STATS)


class CachedNaturalReader(NaturalReader):
    """Writers parsed once into memory (LEAF JSON, Shakespeare text): small once converted."""

    def __init__(self, cfg, opts):
        super().__init__(cfg, opts)
        self._writers: Optional[List[Tuple[np.ndarray, np.ndarray]]] = None
        self._test: Optional[Tuple[np.ndarray, np.ndarray]] = None

    def parse(self) -> Tuple[List[Tuple[np.ndarray, np.ndarray]], Tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError

    def _ensure(self):
        if self._writers is None:
            self._writers, self._test = self.parse()

    def writer_counts(self) -> np.ndarray:
        self._ensure()
        return np.array([len(y) for _, y in self._writers], dtype=np.int64)

    def load_writer(self, k: int):
        self._ensure()
        return self._writers[k]

    def test_source(self):
        self._ensure()
        return ArrayClients.blocks(*self._test)


class FemnistLEAF(CachedNaturalReader):
    name = "femnist"
    num_classes = 62
    x_tail = (1, 28, 28)

    def __init__(self, cfg, opts, root):
        super().__init__(cfg, opts)
        self.root = root

    def source_files(self) -> List[str]:
        return leaf_json_files(self.root, "train", LEAF_FEMNIST) + leaf_json_files(self.root, "test", LEAF_FEMNIST)

    def _split(self, split):
        users: Dict[str, List[Tuple[np.ndarray, np.ndarray]]] = {}
        for user, x, y in iter_leaf_users(self.root, split, LEAF_FEMNIST):
            where = f"{self.root}/{split} user {user!r}"
            try:
                px = np.asarray(x, dtype=np.float32)
            except ValueError:
                raise _shape_error(where, "x as lists of 784 floats", "ragged lists", LEAF_FEMNIST)
            if px.ndim != 2 or px.shape[1] != 784:
                raise _shape_error(where, "x as lists of 784 floats", px.shape, LEAF_FEMNIST)
            yy = np.asarray(y, dtype=np.int64)
            check_labels(yy, self.num_classes, where, LEAF_FEMNIST)
            users.setdefault(user, []).append((pixels_to_uint8(px, self.opts.invert).reshape(-1, 1, 28, 28), yy))
        return {u: (np.concatenate([a for a, _ in v]), np.concatenate([b for _, b in v]))
                for u, v in sorted(users.items())}

    def parse(self):
        train = self._split("train")
        test = self._split("test")
        tx = np.concatenate([v[0] for v in test.values()]) if test else np.empty((0, 1, 28, 28), np.uint8)
        ty = np.concatenate([v[1] for v in test.values()]) if test else np.empty(0, np.int64)
        return list(train.values()), (tx, ty)

    def transform(self):
        return image_transform(self.opts, EMNIST_STATS)


def _natural_root(cfg, opts, subdir: str, name: str) -> str:
    if opts.dir:
        return opts.dir
    return os.path.join(require_data_dir(cfg, name, subdir + "/"), subdir)


def _pick_source(opts, root: str, tff_file: str, tff: Published, leaf: Published, tff_layout: str) -> str:
    """'tff' or 'leaf' from the source option and what exists under root."""
    if opts.source != "auto":
        return opts.source
    if os.path.isfile(os.path.join(root, tff_file)):
        return "tff"
    if os.path.isdir(os.path.join(root, "train")):
        return "leaf"
    raise DataError(
        f"no dataset files found in {root}: expected "
        f"{os.path.join(root, tff_file)} ({tff_layout}; {tff.where()}) or "
        f"{os.path.join(root, 'train', '*.json')} and {os.path.join(root, 'test', '*.json')} "
        f"(LEAF JSON; {leaf.where()}); set --data-dir, or the dataset option dir=FOLDER"
    )


@register_dataset("femnist", FemnistOptions,
                  "FEMNIST by writer: TFF HDF5 or LEAF JSON (<data_dir>/femnist), natural partition")
def build_femnist(cfg, options: FemnistOptions = None):
    opts = _opts(options, FemnistOptions)
    root = _natural_root(cfg, opts, "femnist", "femnist")
    tff_file = "fed_emnist_digitsonly_train.h5" if opts.only_digits else "fed_emnist_train.h5"
    source = _pick_source(opts, root, tff_file, TFF_EMNIST, LEAF_FEMNIST,
                          "TFF HDF5 layout examples/<writer>/pixels + label")
    reader = FemnistTFF(cfg, opts, root) if source == "tff" else FemnistLEAF(cfg, opts, root)
    return assemble(reader)


@register_dataset("cifar100_tff", Cifar100TffOptions,
                  "CIFAR-100 with TFF's 500 natural clients (<data_dir>/cifar100_tff/fed_cifar100_*.h5)")
def build_cifar100_tff(cfg, options: Cifar100TffOptions = None):
    opts = _opts(options, Cifar100TffOptions)
    return assemble(Cifar100TFF(cfg, opts, _natural_root(cfg, opts, "cifar100_tff", "cifar100_tff")))


class ShakespeareReader(CachedNaturalReader):
    """Next-character prediction: x = L character ids, y = the next character at each position."""

    name = "shakespeare"
    task = "next_char"
    num_classes = len(SHAKESPEARE_VOCAB)
    y_dtype = np.uint8

    def __init__(self, cfg, opts, root, source):
        super().__init__(cfg, opts)
        self.root, self.source = root, source
        self.x_tail = self.y_tail = (opts.seq_len,)

    def source_files(self) -> List[str]:
        if self.source == "tff":
            return [self._tff_path("train"), self._tff_path("test")]
        return leaf_json_files(self.root, "train", LEAF_SHAKESPEARE) + leaf_json_files(self.root, "test", LEAF_SHAKESPEARE)

    def _tff_path(self, split):
        return os.path.join(self.root, f"shakespeare_{split}.h5")

    def writer_labels(self, y):
        return y[:, -1]  # synthetic partitions see the character that follows each sequence

    def _tff_split(self, split) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        out = {}
        with TFFClientFile(self._tff_path(split), ("snippets",), TFF_SHAKESPEARE,
                           f"TFF Shakespeare {split} file") as f:
            for cid in f.client_ids():
                text = "\n".join(decode_strings(f.read_client(cid)["snippets"]))
                out[cid] = char_sequences(encode_chars(text), self.opts.seq_len)
        return out

    def _leaf_split(self, split) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        L = self.opts.seq_len
        users: Dict[str, List[str]] = {}
        for user, xs, ys in iter_leaf_users(self.root, split, LEAF_SHAKESPEARE):
            windows = []
            for x, y in zip(xs, ys):
                w = f"{x}{y}"
                if len(w) < L + 1:
                    raise ConfigError(
                        f"LEAF Shakespeare samples of user {user!r} hold {len(w) - 1} input characters; "
                        f"use the data option seq_len={len(w) - 1} or smaller"
                    )
                windows.append(w[-(L + 1):])
            users.setdefault(user, []).extend(windows)
        out = {}
        for user, windows in sorted(users.items()):
            ids = encode_chars("".join(windows)).reshape(len(windows), L + 1)
            out[user] = (ids[:, :-1].copy(), ids[:, 1:].copy())
        return out

    def parse(self):
        read = self._tff_split if self.source == "tff" else self._leaf_split
        train, test = read("train"), read("test")
        L = self.opts.seq_len
        tx = np.concatenate([v[0] for v in test.values()] + [np.empty((0, L), np.uint8)])
        ty = np.concatenate([v[1] for v in test.values()] + [np.empty((0, L), np.uint8)])
        return list(train.values()), (tx, ty)

    def transform(self):
        return token_ids


@register_dataset("shakespeare", ShakespeareOptions,
                  "Shakespeare next-character prediction by speaking role: TFF HDF5 or LEAF JSON (<data_dir>/shakespeare)")
def build_shakespeare(cfg, options: ShakespeareOptions = None):
    opts = _opts(options, ShakespeareOptions)
    root = _natural_root(cfg, opts, "shakespeare", "shakespeare")
    source = _pick_source(opts, root, "shakespeare_train.h5", TFF_SHAKESPEARE, LEAF_SHAKESPEARE,
                          "TFF HDF5 layout examples/<role>/snippets")
    return assemble(ShakespeareReader(cfg, opts, root, source))


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
            raise missing(
                "prepared ImageNet subset", self.path,
                "HDF5 written by `python -m fedhpc.data.prepare imagenet200 --src <ImageNet dir> "
                f"--out {self.path} --size 64 --seed 0`", IMAGENET,
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

    def _file(self):
        if self._h5 is None:
            try:
                self._h5 = open_h5_readonly(self.path)
            except OSError as e:
                raise DataError(f"{self.path} cannot be opened as HDF5 ({e}); prepare it again")
        return self._h5

    def source_files(self) -> List[str]:
        return [self.path]

    def estimate_bytes(self) -> int:
        ds = self._file()["train/x"]
        return int(np.prod(ds.shape)) * ds.dtype.itemsize

    def load_pool(self, lazy: bool = False) -> Pool:
        f = self._file()
        y = f["train/y"][()].astype(np.int64)
        yt = f["val/y"][()].astype(np.int64)
        check_labels(y, self.num_classes, self.path, IMAGENET)
        x = f["train/x"] if lazy else f["train/x"][()]
        xt = f["val/x"] if lazy else f["val/x"][()]
        return Pool(x, y, xt, yt, y)

    def transform(self):
        return image_transform(self.opts, IMAGENET_STATS)

    def close(self) -> None:
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None


@register_dataset("imagenet200", Imagenet200Options,
                  "200-class ImageNet subset prepared by `python -m fedhpc.data.prepare imagenet200`")
def build_imagenet200(cfg, options: Imagenet200Options = None):
    return assemble(Imagenet200Reader(cfg, _opts(options, Imagenet200Options)))
