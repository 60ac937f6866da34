"""Small models for the embedded digits data (and any small image input)."""

from __future__ import annotations

import math

from torch import nn

from ..errors import ConfigError

from . import register_model
from .shapes import image_shape
from .vision import ConvBlocksWithHead


class MLP(nn.Module):
    def __init__(self, input_shape, num_classes: int, hidden: int = 64, depth: int = 2):
        super().__init__()
        dims = [math.prod(input_shape)] + [hidden] * (depth - 1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(dims[:-1], dims[1:])
        )
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x):
        x = x.flatten(1)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def layers(self):
        return [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)] + [("head", self.head)]


def check_norm_dropout(model: str, norm: str, dropout: float) -> None:
    """The test-model options every small CNN here takes: norm none|batch, dropout in [0, 1)."""
    if norm not in ("none", "batch"):
        raise ConfigError(f"{model} option norm must be none or batch, got {norm!r}")
    if not 0 <= dropout < 1:
        raise ConfigError(f"{model} option dropout must be in [0, 1), got {dropout}")


class SmallCNN(nn.Module):
    """Two 3x3 conv blocks and two fc layers; sized for 8x8 digits but works on any HxW.

    ``norm="batch"`` puts BatchNorm after each convolution and ``dropout`` > 0 a dropout
    before the head: the small stand-ins with which the tests check that BatchNorm
    statistics and random masks behave the same on any number of ranks.
    """

    def __init__(self, input_shape, num_classes: int, width: int = 16, hidden: int = 64,
                 norm: str = "none", dropout: float = 0.0):
        super().__init__()
        check_norm_dropout("cnn", norm, dropout)
        c, h, w = image_shape(input_shape)

        def bn(ch):
            return [nn.BatchNorm2d(ch)] if norm == "batch" else []

        self.conv1 = nn.Sequential(nn.Conv2d(c, width, 3, padding=1), *bn(width), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), *bn(2 * width), nn.ReLU(),
                                   nn.MaxPool2d(2))
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * (h // 2) * (w // 2), hidden), nn.ReLU(),
                                *([nn.Dropout(dropout)] if dropout > 0 else []))
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(self.fc(self.conv2(self.conv1(x))))

    def layers(self):
        return [("conv1", self.conv1), ("conv2", self.conv2), ("fc", self.fc), ("head", self.head)]


@register_model("mlp")
def mlp(input_shape, num_classes, hidden: int = 64, depth: int = 2):
    return MLP(input_shape, num_classes, hidden, depth)


@register_model("cnn")
def cnn(input_shape, num_classes, width: int = 16, hidden: int = 64, norm: str = "none", dropout: float = 0.0):
    return SmallCNN(input_shape, num_classes, width, hidden, norm, dropout)


class PMixFedDigitsCNN(ConvBlocksWithHead):
    """pMixFed's "4 convolutional layers (1 block each) and 1 fully connected layer", sized for
    8x8 digits: four 3x3 conv blocks (padding 1, optional BatchNorm, ReLU), a 2x2 max-pool
    after the second and the fourth (8x8 -> 2x2), one linear head. ``layers()`` lists the four
    conv blocks and the head, so the paper's "layers [1,2] shared" is ``first:half``.
    ``dropout`` > 0 drops features before the head (the standard tests' dropout stand-in).
    """

    def __init__(self, input_shape, num_classes: int, channels: int = 16, norm: str = "batch",
                 dropout: float = 0.0):
        super().__init__()
        check_norm_dropout("pmixfed_cnn_digits", norm, dropout)
        c, h, w = image_shape(input_shape)
        blocks, in_ch = [], c
        for i in range(4):
            layers = [nn.Conv2d(in_ch, channels, 3, padding=1)]
            layers += [nn.BatchNorm2d(channels)] if norm == "batch" else []
            layers += [nn.ReLU()] + ([nn.MaxPool2d(2)] if i % 2 == 1 else [])
            blocks.append(nn.Sequential(*layers))
            in_ch = channels
        self.convs = nn.ModuleList(blocks)
        if h // 4 < 1 or w // 4 < 1:
            raise ConfigError(f"pmixfed_cnn_digits needs inputs of at least 4x4, got {h}x{w}")
        self.head = nn.Sequential(nn.Flatten(), *([nn.Dropout(dropout)] if dropout > 0 else []),
                                  nn.Linear(channels * (h // 4) * (w // 4), num_classes))


@register_model("pmixfed_cnn_digits")
def pmixfed_cnn_digits(input_shape, num_classes, channels: int = 16, norm: str = "batch", dropout: float = 0.0):
    return PMixFedDigitsCNN(input_shape, num_classes, channels, norm, dropout)
