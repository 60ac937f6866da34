"""scikit-learn's handwritten digits (1,797 8x8 images, 10 classes): the embedded default.

It ships inside scikit-learn, so fedhpc runs and tests with nothing downloaded.
A seeded, stratified ``test_fraction`` of it is the global test set; the rest is
the pool that the partition spreads over clients.

A run on digits that sets no lr / local epochs takes digits' own (:data:`DIGITS_SETTINGS`: lr
0.1, two epochs), and ``--model auto`` is the ``cnn``, or ``resnet_digits`` for the methods that
need a residual network (:data:`DIGITS_MODELS`; :mod:`fedhpc.config.auto`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

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


def bundled_digits_csv() -> Optional[np.ndarray]:
    """The (1797, 65) table scikit-learn ships as ``datasets/data/digits.csv.gz`` (64 pixels, then
    the label), read with numpy, or None where a scikit-learn version keeps it elsewhere.

    ``load_digits`` reads exactly this file with ``np.loadtxt``; importing ``sklearn.datasets``
    to call it also imports scipy.stats and the rest of scikit-learn, 1-2 s at every launch, on
    every rank and in every subprocess of the test suite."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if not os.path.isfile(path):
        return None
    try:
        table = np.loadtxt(path, delimiter=",")
    except (OSError, ValueError, EOFError):  # unreadable here: load_digits reads it, or says why not
        return None
    return table if table.ndim == 2 and table.shape[1] == 65 else None


def load_digits_arrays():
    table = bundled_digits_csv()
    if table is None:
        from sklearn.datasets import load_digits
        d = load_digits()
        images, target = d.images, d.target
    else:  # what load_digits makes of the file
        images, target = table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    # Pixels are 0..16 intensities; store them as float32 in [0, 1], shape (N, 1, 8, 8).
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    return x, target.astype(np.int64)


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


#: what a run on digits takes when it does not set it (fedhpc.config.auto; the launch files set their
#: own). RunConfig's lr 0.05 and one local epoch hardly move the cnn in the default 20 rounds of 10 of 20
#: clients with ~57 images each: FedAvg 58.8%, FD's devices 11.7% and FedSim's 12.5% (chance 10%), Per-
#: FedAvg 21.7%. lr 0.1 and two epochs: FedAvg 93.0%, every method's reported accuracy 0.55-0.97 in
#: about 6-50 s on one core (FD's devices 0.55 / 0.64, FedAlt's 0.60 the lowest). lr 0.2 did better
#: on most (FedAvg 96.1%) but FedAlt's alternating updates oscillated there (0.29 on two threads).
#: mnist5k sets none: its 160 images per client reach 0.93 with RunConfig's (FedAvg, 20 rounds)
DIGITS_SETTINGS = {"lr": 0.1, "local_epochs": 2}
#: --model auto on digits: the cnn; the FedAlign family's residual network (StochDepth's blocks,
#: FedAlign's and GradAug's slimmable widths, MOON's head) is resnet_digits
DIGITS_MODELS = {"default": "cnn", "residual": "resnet_digits"}


@register_dataset("digits", DigitsOptions, "scikit-learn handwritten digits, 8x8, 10 classes (embedded)",
                  settings=DIGITS_SETTINGS, models=DIGITS_MODELS, auto_partition="iid")
def build_digits(cfg, options: DigitsOptions = None):
    options = options or DigitsOptions()
    x, y = load_digits_arrays()
    pool, test = stratified_holdout(y, options.test_fraction, cfg.seed)
    parts = make_partition(cfg.partition, y[pool], cfg.num_clients, cfg.seed, min_samples=2)
    return ArrayFederatedData(
        "digits", x[pool], y[pool], x[test], y[test], parts, num_classes=10,
        client_test_fraction=cfg.client_test_fraction, seed=cfg.seed, default_model=DIGITS_MODELS["default"],
    )
