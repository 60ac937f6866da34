"""Shape arithmetic the image models share: they compute their flatten sizes from the input shape."""

from __future__ import annotations

from typing import Optional, Tuple

from ..errors import ConfigError


def image_shape(input_shape) -> Tuple[int, int, int]:
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(f"image models need input_shape (C, H, W); got {tuple(input_shape)}")
    return shape  # type: ignore[return-value]


def conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def pool_out(size: int, kernel: int = 2, stride: Optional[int] = None, padding: int = 0) -> int:
    stride = kernel if stride is None else stride
    return (size + 2 * padding - kernel) // stride + 1


def require_positive(name: str, size: int, input_shape) -> None:
    if size < 1:
        raise ConfigError(f"input_shape {tuple(input_shape)} is too small: {name} would be empty; use a model made "
                          f"for small inputs (--model mlp; --model cnn for images of 2x2 or more) or larger inputs "
                          f"(e.g. --data-opt shape=1x28x28 for the synthetic dataset)")
