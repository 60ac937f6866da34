"""Algorithm registry: one file per algorithm, each a subclass of :class:`Algorithm`."""

from __future__ import annotations

import importlib
import pkgutil

from ..registry import Registry
from .base import Algorithm, ClientContext, RoundInfo  # noqa: F401

ALGORITHMS: Registry = Registry("algorithm")


def register_algorithm(name: str):
    def deco(cls):
        cls.name = name
        return ALGORITHMS.register(name)(cls)

    return deco


def load_algorithm_modules() -> None:
    """Import every module of this package so that its algorithms register themselves."""
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base",) and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
