"""Image models of the papers fedhpc reproduces.

======================  ===================================  ========================
registry name           paper and dataset                    default input / classes
======================  ===================================  ========================
``lenet5``              FedMix (App. B), FEMNIST             1x28x28 / 62
``vgg_fedmix``          FedMix (App. B), CIFAR-10/100        3x32x32 / 10 or 100
``resnet56``            FedAlign, CIFAR-10/100 (resnet.py)   3x32x32 / 10 or 100
``resnet18``            FedAlign, ImageNet-200 (resnet.py)   3x64x64 (or 224) / 200
``resnet_digits``       FedAlign on digits (resnet.py)       1x8x8 / 10
``resnet_mnist``        FedAlign on mnist5k (resnet.py)      1x28x28 / 10
``pmixfed_cnn``         pMixFed (Sec. 5.1), CIFAR-10/100     3x32x32 / 10 or 100
``pmixfed_cnn_mnist``   pMixFed (Sec. 5.1), MNIST            1x28x28 / 10
``mobilenet``           pMixFed (Sec. 5.1), CIFAR-10/100     3x32x32 / 10 or 100
``mix2fld_cnn``         Mix2FLD (Sec. IV), MNIST             1x28x28 / 10
======================  ===================================  ========================

Every model takes ``input_shape = (C, H, W)``, computes its flatten sizes from
it, and declares ``layers()``: the ordered ``[(name, module), ...]`` blocks
with parameters, input side first, covering every parameter exactly once (what
the layer-wise algorithms, e.g. pMixFed, mix and split).

Each class docstring says what the paper states and which reading was chosen
where the paper leaves it open.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from . import register_model
from .shapes import conv_out, image_shape, pool_out, require_positive


# --------------------------------------------------------------------------- FedMix
class LeNet5(nn.Module):
    """LeNet-5 as FedMix uses it on FEMNIST.

    FedMix, App. B: "LeNet is consisted of 2 conv layers followed by 2x2
    maxpool layer then 3 fc layers. We used 5x5 conv layers with 6 and 16
    channels. Following fc layers have exactly the same hidden dimension of
    original LeNet-5 model" (LeCun et al. 1998: 120 and 84).

    Readings chosen:

    * a 2x2 max-pool after *each* conv (LeNet-5's S2 and S4 subsampling
      layers), ReLU activations;
    * ``conv1_padding=2``: the original network takes 32x32 inputs; padding the
      28x28 FEMNIST image by 2 keeps the original map sizes (28 -> 14 -> 10 ->
      5), so the first fc layer is 16*5*5 = 400 -> 120 as in LeCun et al.
      ``conv1_padding=0`` gives the unpadded variant (16*4*4 = 256 -> 120).
    """

    def __init__(self, input_shape, num_classes: int, conv1_padding: int = 2):
        super().__init__()
        c, h, w = image_shape(input_shape)
        self.conv1 = nn.Sequential(
            nn.Conv2d(c, 6, 5, padding=conv1_padding), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.conv2 = nn.Sequential(nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2))
        h = pool_out(conv_out(pool_out(conv_out(h, 5, padding=conv1_padding)), 5))
        w = pool_out(conv_out(pool_out(conv_out(w, 5, padding=conv1_padding)), 5))
        require_positive("the conv2 output", min(h, w), input_shape)
        self.fc1 = nn.Sequential(nn.Flatten(), nn.Linear(16 * h * w, 120), nn.ReLU())
        self.fc2 = nn.Sequential(nn.Linear(120, 84), nn.ReLU())
        self.head = nn.Linear(84, num_classes)

    def forward(self, x):
        return self.head(self.fc2(self.fc1(self.conv2(self.conv1(x)))))

    def layers(self):
        return [
            ("conv1", self.conv1),
            ("conv2", self.conv2),
            ("fc1", self.fc1),
            ("fc2", self.fc2),
            ("head", self.head),
        ]


class VGGFedMix(nn.Module):
    """FedMix's VGG-style CIFAR network without batch norm.

    FedMix, App. B: "6 convolutional layers with 3 max pooling layers. 3x3 conv
    layers are stacked and 2x2 maxpool layer is stacked after every 2 conv
    layers. Conv layers have channel sizes of 32, 64, 128, 128, 256, 256. Then
    3 fc layers are stacked with hidden dimension 512. We use Dropout layer
    three times with probability 0.1 after the second, third maxpool layers and
    before the last fc layer. We remove all batch normalization layers."

    Open point: "3 fc layers ... with hidden dimension 512". Reading chosen
    (default ``fc_hidden_layers=2``): three linear layers in all, the last one
    being the classifier, i.e. flatten -> 512 -> 512 -> num_classes; "hidden
    dimension" names the width between them, and the classifier cannot have
    512 outputs. ``fc_hidden_layers=3`` gives the other reading: three
    512-wide fc layers followed by a fourth, classifier, layer.
    Convs use padding 1 (32x32 -> 4x4x256 = 4096 flattened features), ReLU.
    Dropout sits after pools 2 and 3 and right before the classifier.
    """

    CHANNELS = (32, 64, 128, 128, 256, 256)

    def __init__(
        self,
        input_shape,
        num_classes: int,
        dropout: float = 0.1,
        fc_width: int = 512,
        fc_hidden_layers: int = 2,
    ):
        super().__init__()
        c, h, w = image_shape(input_shape)
        if fc_hidden_layers < 1:
            raise ConfigError("vgg_fedmix: fc_hidden_layers must be >= 1")
        convs: List[nn.Module] = []
        in_ch = c
        for i, out_ch in enumerate(self.CHANNELS):
            parts: List[nn.Module] = [nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.ReLU()]
            if i % 2 == 1:  # a pool after every two convs
                parts.append(nn.MaxPool2d(2))
                h, w = pool_out(h), pool_out(w)
                if i >= 3:  # after the second and third pools
                    parts.append(nn.Dropout(dropout))
            convs.append(nn.Sequential(*parts))
            in_ch = out_ch
        require_positive("the third pool's output", min(h, w), input_shape)
        self.convs = nn.ModuleList(convs)
        dims = [in_ch * h * w] + [fc_width] * fc_hidden_layers
        self.fcs = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(dims[:-1], dims[1:])
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(fc_width, num_classes))

    def forward(self, x):
        for block in self.convs:
            x = block(x)
        x = torch.flatten(x, 1)
        for block in self.fcs:
            x = block(x)
        return self.head(x)

    def layers(self):
        return (
            [(f"convs.{i}", b) for i, b in enumerate(self.convs)]
            + [(f"fcs.{i}", b) for i, b in enumerate(self.fcs)]
            + [("head", self.head)]
        )


# --------------------------------------------------------------------------- pMixFed
class ConvBlocksWithHead(nn.Module):
    """pMixFed's CNNs: ``convs`` (a ModuleList of conv blocks) then ``head``; ``layers()`` lists
    the blocks and the head, the "layers" pMixFed mixes and its baselines share or keep."""

    convs: nn.ModuleList
    head: nn.Module

    def forward(self, x):
        for b in self.convs:
            x = b(x)
        return self.head(x)

    def layers(self):
        return [(f"convs.{i}", b) for i, b in enumerate(self.convs)] + [("head", self.head)]


class PMixFedCNN(ConvBlocksWithHead):
    """pMixFed's CIFAR CNN: "4 convolutional layers (1 block each) and 1 fully connected layer".

    The paper gives no channel sizes; it follows the setup of FedBABU [33],
    whose CIFAR CNN is four blocks of (3x3 conv with 64 channels, padding 1,
    BatchNorm, ReLU, 2x2 max-pool) and one linear layer (32x32 -> 2x2x64 =
    256 features). That is the default (``channels=64``). pMixFed's partial
    baselines share "layers [1,2]": ``layers()`` lists the four conv blocks
    and the head.
    """

    def __init__(self, input_shape, num_classes: int, channels: int = 64):
        super().__init__()
        c, h, w = image_shape(input_shape)
        blocks = []
        in_ch = c
        for _ in range(4):
            blocks.append(
                nn.Sequential(
                    nn.Conv2d(in_ch, channels, 3, padding=1),
                    nn.BatchNorm2d(channels),
                    nn.ReLU(),
                    nn.MaxPool2d(2),
                )
            )
            in_ch = channels
            h, w = pool_out(h), pool_out(w)
        require_positive("the fourth pool's output", min(h, w), input_shape)
        self.convs = nn.ModuleList(blocks)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(channels * h * w, num_classes))


class PMixFedCNNMnist(nn.Module):
    """pMixFed's MNIST CNN: "2 convolutional layers (each with 1 block) and 2 fully connected layers".

    No sizes in the paper; chosen as the MNIST CNN of FedBABU [33] (which
    pMixFed follows): 5x5 conv 1->10, max-pool, ReLU; 5x5 conv 10->20,
    channel dropout, max-pool, ReLU; fc 320->50, ReLU, dropout; fc 50->classes
    (dropout p=0.5). Returns logits.
    """

    def __init__(self, input_shape, num_classes: int, channels: Sequence[int] = (10, 20), hidden: int = 50,
                 dropout: float = 0.5):
        super().__init__()
        c, h, w = image_shape(input_shape)
        c1, c2 = (int(v) for v in channels)
        self.conv1 = nn.Sequential(nn.Conv2d(c, c1, 5), nn.MaxPool2d(2), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(c1, c2, 5), nn.Dropout2d(dropout), nn.MaxPool2d(2), nn.ReLU())
        h = pool_out(conv_out(pool_out(conv_out(h, 5)), 5))
        w = pool_out(conv_out(pool_out(conv_out(w, 5)), 5))
        require_positive("the conv2 output", min(h, w), input_shape)
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(c2 * h * w, hidden), nn.ReLU(), nn.Dropout(dropout))
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(self.fc(self.conv2(self.conv1(x))))

    def layers(self):
        return [("conv1", self.conv1), ("conv2", self.conv2), ("fc", self.fc), ("head", self.head)]


class MobileNet(nn.Module):
    """MobileNet (v1, Howard et al. 2017) as pMixFed uses it on CIFAR.

    pMixFed: "MobileNet, which comprises 14 convolutional layers (2 blocks
    each) and 1 fully connected layer": a standard 3x3 conv (32 channels) and
    13 depthwise-separable layers (3x3 depthwise + BN + ReLU, 1x1 pointwise +
    BN + ReLU; 64, 128/2, 128, 256/2, 256, 512/2, 5x512, 1024/2, 1024, "/2"
    marking stride 2), global average pool, linear classifier. ``layers()``
    has 15 entries (stem, 13 separable layers, head), so the paper's shared
    "layers [1-7]" are the first seven.

    CIFAR adaptation (as in the FedBABU code pMixFed follows): the stem has
    stride 1 (``stem_stride=1``), so 32x32 inputs end at 2x2 before pooling;
    ``stem_stride=2`` is the ImageNet original. ``width_multiplier`` alpha
    thins every layer to round(alpha * channels) (at least 1).
    """

    CFG = (64, (128, 2), 128, (256, 2), 256, (512, 2), 512, 512, 512, 512, 512, (1024, 2), 1024)

    def __init__(self, input_shape, num_classes: int, width_multiplier: float = 1.0, stem_stride: int = 1):
        super().__init__()
        c, h, w = image_shape(input_shape)
        if width_multiplier <= 0:
            raise ConfigError("mobilenet: width_multiplier must be > 0")

        def scaled(ch: int) -> int:
            return max(1, int(round(ch * width_multiplier)))

        in_ch = scaled(32)
        self.stem = nn.Sequential(
            nn.Conv2d(c, in_ch, 3, stride=stem_stride, padding=1, bias=False), nn.BatchNorm2d(in_ch), nn.ReLU()
        )
        h, w = conv_out(h, 3, stem_stride, 1), conv_out(w, 3, stem_stride, 1)
        blocks = []
        for entry in self.CFG:
            out_ch, stride = (entry, 1) if isinstance(entry, int) else entry
            out_ch = scaled(out_ch)
            blocks.append(
                nn.Sequential(
                    nn.Conv2d(in_ch, in_ch, 3, stride=stride, padding=1, groups=in_ch, bias=False),
                    nn.BatchNorm2d(in_ch),
                    nn.ReLU(),
                    nn.Conv2d(in_ch, out_ch, 1, bias=False),
                    nn.BatchNorm2d(out_ch),
                    nn.ReLU(),
                )
            )
            in_ch = out_ch
            h, w = conv_out(h, 3, stride, 1), conv_out(w, 3, stride, 1)
        require_positive("the last separable layer's output", min(h, w), input_shape)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes))

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def layers(self):
        return [("stem", self.stem)] + [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)] + [("head", self.head)]


# --------------------------------------------------------------------------- Mix2FLD
class Mix2FLDCNN(nn.Module):
    """Mix2FLD's "3-layer convolutional neural network model (2 convolutional
    layers, 1 fully-connected layer) having N_mod = 12,544" on MNIST.

    The paper gives nothing else: N_mod is "# of model weights" and enters
    only the payload b_mod * N_mod (32-bit weights). An exhaustive search over
    3x3/5x5 kernels, 'valid'/'same' padding, a 2x2 max-pool after each conv,
    up to 128 and 256 channels, with and without biases, finds only odd
    channel counts (3x3 'same' 49 -> 13 without biases, 3x3 'valid' 73 -> 13
    with biases, ...) and nothing with 5x5 kernels. The count is therefore
    read as weights only, and the model is bias-free so that its parameter
    count is 12,544 under either reading (the simulated FL payload, computed
    from ``parameters()``, then equals the paper's). Chosen configuration
    (default; kernel sizes are this implementation's choice, the paper's are
    unknown):

        conv 7x7, 1 -> 16, no padding, ReLU, 2x2 max-pool   28 -> 22 -> 11     784 weights
        conv 5x5, 16 -> 24, no padding, ReLU, 2x2 max-pool  11 -> 7 -> 3      9,600 weights
        fc 24*3*3 = 216 -> 10                                                 2,160 weights
                                                                      total  12,544

    Other exact configurations exist (e.g. 5x5 'same' 1->16, pool, 4x4
    16->24, pool, fc 600->10); ``channels``, ``kernel_sizes``, ``padding``
    and ``bias`` make any of them available.
    """

    def __init__(self, input_shape, num_classes: int, channels: Sequence[int] = (16, 24),
                 kernel_sizes: Sequence[int] = (7, 5), padding: Sequence[int] = (0, 0), bias: bool = False):
        super().__init__()
        c, h, w = image_shape(input_shape)
        (c1, c2), (k1, k2), (p1, p2) = (tuple(int(v) for v in t) for t in (channels, kernel_sizes, padding))
        self.conv1 = nn.Sequential(nn.Conv2d(c, c1, k1, padding=p1, bias=bias), nn.ReLU(), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(c1, c2, k2, padding=p2, bias=bias), nn.ReLU(), nn.MaxPool2d(2))
        h = pool_out(conv_out(pool_out(conv_out(h, k1, padding=p1)), k2, padding=p2))
        w = pool_out(conv_out(pool_out(conv_out(w, k1, padding=p1)), k2, padding=p2))
        require_positive("the conv2 output", min(h, w), input_shape)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(c2 * h * w, num_classes, bias=bias))

    def forward(self, x):
        return self.head(self.conv2(self.conv1(x)))

    def layers(self):
        return [("conv1", self.conv1), ("conv2", self.conv2), ("head", self.head)]


# --------------------------------------------------------------------------- registry
@register_model("lenet5")
def lenet5(input_shape, num_classes, conv1_padding: int = 2):
    return LeNet5(input_shape, num_classes, conv1_padding)


@register_model("vgg_fedmix")
def vgg_fedmix(input_shape, num_classes, dropout: float = 0.1, fc_width: int = 512, fc_hidden_layers: int = 2):
    return VGGFedMix(input_shape, num_classes, dropout, fc_width, fc_hidden_layers)


@register_model("pmixfed_cnn")
def pmixfed_cnn(input_shape, num_classes, channels: int = 64):
    return PMixFedCNN(input_shape, num_classes, channels)


@register_model("pmixfed_cnn_mnist")
def pmixfed_cnn_mnist(input_shape, num_classes, channels=(10, 20), hidden: int = 50, dropout: float = 0.5):
    return PMixFedCNNMnist(input_shape, num_classes, channels, hidden, dropout)


@register_model("mobilenet")
def mobilenet(input_shape, num_classes, width_multiplier: float = 1.0, stem_stride: int = 1):
    return MobileNet(input_shape, num_classes, width_multiplier, stem_stride)


@register_model("mix2fld_cnn")
def mix2fld_cnn(input_shape, num_classes, channels=(16, 24), kernel_sizes=(7, 5), padding=(0, 0), bias: bool = False):
    return Mix2FLDCNN(input_shape, num_classes, channels, kernel_sizes, padding, bias)
