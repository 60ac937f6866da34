"""Dataset registry. A dataset registers a builder ``build(cfg, options) -> FederatedData``.

``cfg`` is the run's :class:`fedhpc.config.RunConfig` (data_dir, partition,
num_clients, seed, client_test_fraction, ...); ``options`` is an instance of the
dataset's own options dataclass (``data_options`` in YAML, ``--data-opt k=v`` on
the command line), or None when it declares none.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Type

from ..registry import Registry
from .base import ArrayFederatedData, ClientData, FederatedData, default_transform  # noqa: F401
from .partition import make_partition, partition_names  # noqa: F401


@dataclass
class DatasetSpec:
    build: Callable[..., FederatedData]
    options: Optional[Type] = None
    help: str = ""


DATASETS: Registry[DatasetSpec] = Registry("dataset")


def register_dataset(name: str, options: Optional[Type] = None, help: str = ""):
    def deco(fn):
        DATASETS.register(name)(DatasetSpec(fn, options, help))
        return fn

    return deco


# Modules that register datasets when imported. Optional readers (HDF5 etc.) import their
# heavy dependencies lazily inside the builder, so listing them here costs nothing.
_DATASET_MODULES = ["digits", "readers"]


def load_dataset_modules() -> None:
    for mod in _DATASET_MODULES:
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:  # a module not written yet must not break the rest
            if e.name != f"{__name__}.{mod}":
                raise


def build_dataset(cfg: Any, options: Any = None) -> FederatedData:
    load_dataset_modules()
    return DATASETS.get(cfg.dataset).build(cfg, options)
