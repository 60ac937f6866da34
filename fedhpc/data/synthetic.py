"""Synthetic images at the shapes papers train on: throughput benchmarks without the real files.

``--dataset synthetic --data-opt shape=1x28x28`` (MNIST's shape for LeNet-5) or
``shape=3x64x64 --data-opt classes=200`` (ImageNet-200's for ResNet-18) gives a seeded,
learnable classification task of that shape: each class has a fixed random prototype image
and a sample is its class's prototype plus Gaussian noise (``noise`` times unit variance).
It measures what a method costs at a real input size (rounds/s, memory, GPU utilisation);
its accuracies say nothing about the real datasets. ``shape=64`` gives flat 64-feature vectors.

The samples are drawn in chunks, so building 20,000 samples of 3x64x64 (0.9 GiB as float32)
needs little more than the final arrays. The global test set is drawn from the same
distribution; the partition (``--partition``) spreads the training pool over clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from ..errors import ConfigError
from . import register_dataset
from .base import ArrayFederatedData
from .partition import make_partition

#: samples drawn per chunk while building (bounds the temporary memory)
CHUNK = 2048


@dataclass
class SyntheticOptions:
    #: input shape, CxHxW (e.g. 1x28x28, 3x64x64) or N for flat feature vectors
    shape: str = "1x28x28"
    classes: int = 10
    train_samples: int = 6000
    test_samples: int = 1000
    #: standard deviation of the per-sample noise around the class prototype (prototypes have 1)
    noise: float = 1.0

    def dims(self) -> Tuple[int, ...]:
        try:
            dims = tuple(int(d) for d in str(self.shape).lower().split("x"))
        except ValueError:
            dims = ()
        if len(dims) not in (1, 3) or min(dims, default=0) < 1:
            raise ConfigError(f"synthetic shape must be CxHxW (e.g. 1x28x28, 3x64x64) or N (flat features) with "
                              f"positive sizes, got {self.shape!r}: set --data-opt shape=1x28x28")
        return dims

    def validate(self):
        self.dims()
        if self.classes < 2:
            raise ConfigError(f"synthetic classes must be at least 2, got {self.classes}: set --data-opt classes=10")
        if self.train_samples < self.classes or self.test_samples < 1:
            raise ConfigError(f"synthetic train_samples must be >= classes ({self.classes}) and test_samples >= 1, "
                              f"got {self.train_samples} and {self.test_samples}: raise --data-opt train_samples")
        if not self.noise >= 0:
            raise ConfigError(f"synthetic noise must be >= 0, got {self.noise}")


def draw(rng: np.random.Generator, prototypes: np.ndarray, n: int, noise: float):
    """n samples: balanced labels in a shuffled order, each its prototype plus noise (float32)."""
    classes = prototypes.shape[0]
    y = rng.permutation(np.arange(n) % classes).astype(np.int64)
    x = np.empty((n,) + prototypes.shape[1:], dtype=np.float32)
    for start in range(0, n, CHUNK):
        part = y[start:start + CHUNK]
        eps = rng.standard_normal((len(part),) + prototypes.shape[1:], dtype=np.float32)
        x[start:start + CHUNK] = prototypes[part] + np.float32(noise) * eps
    return x, y


@register_dataset("synthetic", SyntheticOptions,
                  "seeded class-prototype images at any shape (shape=1x28x28, classes, train_samples): "
                  "throughput benchmarks at real input sizes, not accuracy claims")
def build_synthetic(cfg, options: SyntheticOptions = None):
    options = options or SyntheticOptions()
    options.validate()
    dims = options.dims()
    rng = np.random.default_rng([cfg.seed, 0x5E17])
    prototypes = rng.standard_normal((options.classes,) + dims, dtype=np.float32)
    x_pool, y_pool = draw(rng, prototypes, options.train_samples, options.noise)
    x_test, y_test = draw(rng, prototypes, options.test_samples, options.noise)
    parts = make_partition(cfg.partition, y_pool, cfg.num_clients, cfg.seed, min_samples=2)
    return ArrayFederatedData(
        "synthetic", x_pool, y_pool, x_test, y_test, parts, num_classes=options.classes,
        client_test_fraction=cfg.client_test_fraction, seed=cfg.seed,
        default_model="mlp" if len(dims) == 1 else "cnn",
    )
