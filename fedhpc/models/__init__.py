"""Model registry.

A model registers ``build(input_shape, num_classes, **options) -> nn.Module``;
options come from ``model_options`` (YAML) or ``--model-opt k=v`` and are checked
against the builder's keyword arguments.

Layer-wise algorithms (pMixFed, FedPer, LG-FedAvg, FedBABU, ...) need an ordered
list of "layers": blocks with parameters from input to output. A model declares
them with a ``layers()`` method returning ``[(name, module), ...]``;
:func:`model_layers` falls back to the top-level children that own parameters.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, List, Tuple

from torch import nn

from ..errors import ConfigError
from ..registry import Registry

MODELS: Registry = Registry("model")


def register_model(name: str):
    return MODELS.register(name)


_MODEL_MODULES = ["simple", "vision", "resnet", "text"]


def load_model_modules() -> None:
    for mod in _MODEL_MODULES:
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{mod}":
                raise


def build_model(name: str, input_shape, num_classes: int, options: Dict[str, Any] | None = None) -> nn.Module:
    load_model_modules()
    builder = MODELS.get(name)
    options = dict(options or {})
    params = inspect.signature(builder).parameters
    accepted = [p for p in params if p not in ("input_shape", "num_classes")]
    unknown = [k for k in options if k not in params]
    if unknown:
        raise ConfigError(
            f"model {name!r} has no option(s) {unknown}; it accepts: {accepted or 'none'}"
        )
    return builder(tuple(input_shape), int(num_classes), **options)


def model_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Ordered parameter-owning blocks of ``model`` (input side first)."""
    if hasattr(model, "layers"):
        return list(model.layers())
    return [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())]
