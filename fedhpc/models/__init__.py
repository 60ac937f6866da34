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

import difflib
import importlib
import inspect
import math
import re
from typing import Any, Dict, List, Tuple, get_type_hints

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


def _as_flag(value: Any) -> str:
    """``value`` as one writes it after ``--model-opt KEY=``."""
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_as_flag(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_option_value(where: str, value: Any, kind: type, zero_ok: bool) -> str:
    """What is wrong with one scalar option value of declared ``kind`` ('' when nothing)."""
    if kind is bool:
        return "" if isinstance(value, bool) else "must be true or false"
    if kind is str:
        return "" if isinstance(value, str) else "must be a string"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be {'an integer' if kind is int else 'a number'}"
    if kind is int:
        if not isinstance(value, int):
            return "must be an integer"
        # Integer options are sizes and counts (channels, widths, layers, strides): never negative, and
        # 0 only where it means "none"/"off" (a padding, or an option whose default is 0).
        if value < (0 if zero_ok else 1):
            return "must be >= 0" if zero_ok else "is a size and must be a positive integer"
        return ""
    if not math.isfinite(value) or value < 0:  # rates and multipliers (dropout, width_multiplier)
        return "must be a finite non-negative number"
    return ""


def check_model_options(name: str, options: Dict[str, Any]) -> None:
    """Refuse options model ``name`` does not take, or values of the wrong type or range.

    Pure (no data needed), so the launcher and the sweep refuse a bad option before any
    dataset is loaded. Options are the builder's keyword parameters; each one's type is its
    annotation, else its default's type; a tuple default (``channels=(16, 24)``) declares a
    list of that many values of its elements' type. Model-specific rules (``norm`` none or
    batch, ``dropout`` below 1, input sizes) stay with the model, which knows them.
    """
    params = model_option_params(name)
    builder = MODELS.get(name)
    unknown = [k for k in options if k not in params]
    if unknown:
        near = [m for k in unknown for m in difflib.get_close_matches(str(k), list(params), n=1)]
        hint = f" (did you mean {near[0]!r}?)" if len(unknown) == 1 and near else ""
        raise ConfigError(
            f"model {name!r} has no option(s) {unknown}{hint}; it accepts: {list(params) or 'none'}"
        )
    try:
        hints = get_type_hints(builder)
    except Exception:  # an annotation that cannot be resolved: fall back to the defaults' types
        hints = {}
    for key, value in options.items():
        default = params[key].default
        has_default = default is not inspect.Parameter.empty
        zero_ok = "padding" in key
        if has_default and isinstance(default, (tuple, list)) and default:
            kind, count = type(default[0]), len(default)
            zero_ok = zero_ok or all(d == 0 for d in default)
        else:
            kind, count = hints.get(key), None
            if kind not in (bool, int, float, str):
                kind = type(default) if has_default and type(default) in (bool, int, float, str) else None
            zero_ok = zero_ok or (has_default and default == 0)
        if kind is None:
            continue  # nothing declared to check against
        if count is not None:
            if not isinstance(value, (list, tuple)) or len(value) != count:
                problem = f"must be a list of {count} values"
            else:
                problem = next((p for p in (_check_option_value(key, v, kind, zero_ok) for v in value) if p), "")
                problem = problem and f"holds a value that {problem}"
        else:
            problem = _check_option_value(key, value, kind, zero_ok)
        if problem:
            example = f"; e.g. --model-opt {key}={_as_flag(default)} (the default)" if has_default else ""
            raise ConfigError(f"model {name!r} option {key!r} {problem}, got {value!r}{example}")


def model_option_params(name: str) -> Dict[str, inspect.Parameter]:
    """Model ``name``'s options: its builder's keyword parameters (all but input_shape and
    num_classes), with their defaults."""
    load_model_modules()
    return {k: p for k, p in inspect.signature(MODELS.get(name)).parameters.items()
            if k not in ("input_shape", "num_classes")}


def build_model(name: str, input_shape, num_classes: int, options: Dict[str, Any] | None = None) -> nn.Module:
    load_model_modules()
    builder = MODELS.get(name)
    options = dict(options or {})
    check_model_options(name, options)
    try:
        return builder(tuple(input_shape), int(num_classes), **options)
    except (MemoryError, RuntimeError) as e:
        # torch's CPU allocator raises a RuntimeError ("can't allocate memory"), CUDA's an OutOfMemoryError
        if not isinstance(e, MemoryError) and "alloc" not in str(e).lower() and "out of memory" not in str(e).lower():
            raise
        given = ", ".join(f"{k}={v}" for k, v in options.items()) or "its defaults"
        asked = re.search(r"tried to allocate ([\d.]+ ?[KMGTP]?i?B|\d+ bytes)", str(e))
        raise ConfigError(f"model {name!r} with {given} does not fit in memory"
                          f"{f' (it tried to allocate {asked.group(1)})' if asked else ''}; lower its size options "
                          f"(--model-opt)") from None


def model_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Ordered parameter-owning blocks of ``model`` (input side first)."""
    if hasattr(model, "layers"):
        return list(model.layers())
    return [(n, m) for n, m in model.named_children() if any(True for _ in m.parameters())]
