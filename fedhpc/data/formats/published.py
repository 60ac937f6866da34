"""Where each dataset is published, and the two shapes of a data-file error that quote it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import DataError



@dataclass(frozen=True)
class Published:
    """Where a dataset is distributed, quoted in every error about its files."""

    title: str
    url: str

    def where(self) -> str:
        return f"{self.title} is published at {self.url}"


MNIST = Published("MNIST", "http://yann.lecun.com/exdb/mnist/")
FASHION_MNIST = Published("Fashion-MNIST", "https://github.com/zalandoresearch/fashion-mnist")
EMNIST = Published(
    "EMNIST", "https://www.nist.gov/itl/products-and-services/emnist-dataset (gzip.zip, IDX files)"
)
CIFAR10 = Published("CIFAR-10", "https://www.cs.toronto.edu/~kriz/cifar.html (cifar-10-python.tar.gz)")
CIFAR100 = Published("CIFAR-100", "https://www.cs.toronto.edu/~kriz/cifar.html (cifar-100-python.tar.gz)")
TFF_EMNIST = Published(
    "TFF federated EMNIST", "https://storage.googleapis.com/tff-datasets-public/fed_emnist.tar.bz2"
)
TFF_EMNIST_DIGITS = Published(
    "TFF federated EMNIST (digits only)",
    "https://storage.googleapis.com/tff-datasets-public/fed_emnist_digitsonly.tar.bz2",
)
TFF_CIFAR100 = Published(
    "TFF federated CIFAR-100", "https://storage.googleapis.com/tff-datasets-public/fed_cifar100.tar.bz2"
)
TFF_SHAKESPEARE = Published(
    "TFF Shakespeare", "https://storage.googleapis.com/tff-datasets-public/shakespeare.tar.bz2"
)
LEAF_FEMNIST = Published(
    "LEAF FEMNIST", "https://github.com/TalwalkarLab/leaf (data/femnist, produced by ./preprocess.sh)"
)
LEAF_SHAKESPEARE = Published(
    "LEAF Shakespeare", "https://github.com/TalwalkarLab/leaf (data/shakespeare, produced by ./preprocess.sh)"
)
IMAGENET = Published(
    "ImageNet (ILSVRC2012)",
    "https://image-net.org/download.php (train/ and val/ with one folder per class wnid)",
)


def missing(what: str, expected: str, layout: str, published: Published, fix: str = "") -> DataError:
    """The one shape of a 'file not found' error: what, the expected path, its layout, its source."""
    msg = f"{what} not found: expected {expected} ({layout}; {published.where()})"
    if fix:
        msg += f"; {fix}"
    return DataError(msg)


def malformed(path: str, problem: str, layout: str, published: Published) -> DataError:
    return DataError(
        f"{path} is not a valid {layout} file: {problem}; replace it with an intact copy "
        f"({published.where()})"
    )


def _first_non_integer(values: np.ndarray):
    """The first value that is not a whole number (bools, strings, None, 1.7, NaN), else None."""
    for v in values.ravel().tolist():
        if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
            return v
    return None


def integer_labels(labels, where: str, published: Published) -> np.ndarray:
    """Class labels as int64, refusing what the cast would silently change or choke on.

    ``astype(int64)`` truncates 1.7 to 1 and raises a bare ValueError on strings; a label that is
    not a whole number means the file is corrupt or from another dataset, so it is named instead.
    Whole numbers stored as floats (1.0) are exact and accepted.
    """
    arr = np.asarray(labels)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    bad = _first_non_integer(arr)
    if bad is None:
        return arr.astype(np.int64)
    raise DataError(
        f"{where} has a label {bad!r} ({type(bad).__name__}); labels are whole-number class ids, so the file "
        f"is corrupt or from another dataset: replace it with an intact copy ({published.where()})"
    )
