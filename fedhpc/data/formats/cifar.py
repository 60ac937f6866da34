"""CIFAR-10 / CIFAR-100 "python version" pickles, unpickled with an allow-list of globals (numpy
array reconstruction only), so a tampered file cannot run code."""

from __future__ import annotations

import codecs
import os
import pickle
from typing import Tuple

import numpy as np

from .published import CIFAR10, CIFAR100, Published, integer_labels, malformed, missing


def _resolve_reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _resolve_frombuffer():
    try:
        from numpy._core.numeric import _frombuffer
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.numeric import _frombuffer
    return _frombuffer


# The only globals a CIFAR batch needs: numpy array/dtype reconstruction, plus
# _codecs.encode, which protocol-2 pickles written by Python 3 use for bytes.
_PICKLE_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _resolve_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _resolve_reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _resolve_frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _resolve_frombuffer,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
    ("_codecs", "encode"): lambda: codecs.encode,
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickler that refuses every global except numpy array reconstruction."""

    def find_class(self, module, name):
        resolve = _PICKLE_ALLOWED.get((module, name))
        if resolve is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        return resolve()


def read_cifar_batch(path: str, label_key: str, published: Published) -> Tuple[np.ndarray, np.ndarray]:
    """One CIFAR python batch -> (uint8 images (N, 3, 32, 32), int64 labels (N,)).

    The batches are Python 2 pickles of a dict with byte-string keys (``b'data'``:
    uint8 (N, 3072) rows holding the R, G and B planes, ``b'labels'`` or
    ``b'fine_labels'``/``b'coarse_labels'``: lists of ints).
    """
    layout = "CIFAR python pickle batch"
    if not os.path.isfile(path):
        raise missing(f"{published.title} batch", path, "python pickle batch", published,
                      "extract the python version archive into --data-dir")
    try:
        with open(path, "rb") as f:
            batch = _ArrayOnlyUnpickler(f, encoding="bytes").load()
    except Exception as e:  # any unpickling failure means the file is not a CIFAR batch
        raise malformed(path, f"cannot be unpickled ({type(e).__name__}: {e})", layout, published)
    if not isinstance(batch, dict):
        raise malformed(path, f"holds a {type(batch).__name__}, expected a dict", layout, published)
    batch = {(k.decode("latin-1") if isinstance(k, bytes) else k): v for k, v in batch.items()}
    for key in ("data", label_key):
        if key not in batch:
            raise malformed(path, f"has no {key!r} entry (keys: {sorted(batch)})", layout, published)
    data = np.asarray(batch["data"])
    try:
        labels = np.asarray(batch[label_key])
    except ValueError as e:  # ragged nested lists
        raise malformed(path, f"{label_key!r} is not a list of class ids ({e})", layout, published)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise malformed(path, f"'data' must be uint8 of shape (N, 3072), got {data.dtype} {data.shape}",
                        layout, published)
    if labels.ndim != 1 or len(labels) != len(data):
        raise malformed(path, f"{len(data)} images but {labels.shape} labels", layout, published)
    return data.reshape(-1, 3, 32, 32).copy(), integer_labels(labels, f"{path} ({label_key!r})", published)


def read_cifar10(root: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``<root>/data_batch_1..5`` and ``<root>/test_batch`` -> (x_train, y_train, x_test, y_test)."""
    names = [f"data_batch_{i}" for i in range(1, 6)]
    for name in names + ["test_batch"]:
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            raise missing(
                "CIFAR-10 batch", path, "CIFAR-10 python version: data_batch_1..5 and test_batch", CIFAR10,
                "extract cifar-10-python.tar.gz into --data-dir (it creates cifar-10-batches-py/)",
            )
    parts = [read_cifar_batch(os.path.join(root, n), "labels", CIFAR10) for n in names]
    x_test, y_test = read_cifar_batch(os.path.join(root, "test_batch"), "labels", CIFAR10)
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    return x, y, x_test, y_test


def read_cifar100(root: str, label: str = "fine") -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``<root>/train`` and ``<root>/test`` with ``fine_labels`` (100) or ``coarse_labels`` (20)."""
    for name in ("train", "test"):
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            raise missing(
                "CIFAR-100 batch", path, "CIFAR-100 python version: files train and test", CIFAR100,
                "extract cifar-100-python.tar.gz into --data-dir (it creates cifar-100-python/)",
            )
    key = f"{label}_labels"
    x, y = read_cifar_batch(os.path.join(root, "train"), key, CIFAR100)
    x_test, y_test = read_cifar_batch(os.path.join(root, "test"), key, CIFAR100)
    return x, y, x_test, y_test
