"""scikit-learn's handwritten digits (1,797 8x8 images, 10 classes): the embedded default.

It ships inside scikit-learn, so fedhpc runs and tests with nothing downloaded.
A seeded, stratified ``test_fraction`` of it is the global test set; the rest is
the pool that the partition spreads over clients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import register_dataset
from .base import ArrayFederatedData
from .partition import make_partition


@dataclass
class DigitsOptions:
    #: share of the 1,797 images held out as the global test set
    test_fraction: float = 0.2

    def validate(self):
        from ..errors import ConfigError

        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"digits test_fraction must be in (0, 1), got {self.test_fraction}")


def load_digits_arrays():
    from sklearn.datasets import load_digits

    d = load_digits()
    # Pixels are 0..16 intensities; store them as float32 in [0, 1], shape (N, 1, 8, 8).
    x = (d.images.astype(np.float32) / 16.0)[:, None, :, :]
    return x, d.target.astype(np.int64)


def stratified_holdout(labels: np.ndarray, fraction: float, seed: int):
    rng = np.random.default_rng([seed, 0x7E57])
    test = []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        test.append(idx[: int(round(len(idx) * fraction))])
    test = np.sort(np.concatenate(test))
    mask = np.ones(len(labels), bool)
    mask[test] = False
    return np.flatnonzero(mask), test


@register_dataset("digits", DigitsOptions, "scikit-learn handwritten digits, 8x8, 10 classes (embedded)")
def build_digits(cfg, options: DigitsOptions = None):
    options = options or DigitsOptions()
    x, y = load_digits_arrays()
    pool, test = stratified_holdout(y, options.test_fraction, cfg.seed)
    parts = make_partition(cfg.partition, y[pool], cfg.num_clients, cfg.seed, min_samples=2)
    return ArrayFederatedData(
        "digits", x[pool], y[pool], x[test], y[test], parts, num_classes=10,
        client_test_fraction=cfg.client_test_fraction, seed=cfg.seed, default_model="cnn",
    )
