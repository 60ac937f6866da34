"""Image models of the papers fedhpc reproduces.

======================  ===================================  ========================
registry name           paper and dataset                    default input / classes
======================  ===================================  ========================
``lenet5``              FedMix (App. B), FEMNIST             1x28x28 / 62
``vgg_fedmix``          FedMix (App. B), CIFAR-10/100        3x32x32 / 10 or 100
``resnet56``            FedAlign, CIFAR-10/100               3x32x32 / 10 or 100
``resnet18``            FedAlign, ImageNet-200               3x64x64 (or 224) / 200
``resnet_digits``       FedAlign family on digits (tests)    1x8x8 / 10
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

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from . import register_model


# --------------------------------------------------------------------------- helpers
def _image_shape(input_shape) -> Tuple[int, int, int]:
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(f"image models need input_shape (C, H, W); got {tuple(input_shape)}")
    return shape  # type: ignore[return-value]


def _conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _pool_out(size: int, kernel: int = 2, stride: Optional[int] = None, padding: int = 0) -> int:
    stride = kernel if stride is None else stride
    return (size + 2 * padding - kernel) // stride + 1


def _require_positive(name: str, size: int, input_shape) -> None:
    if size < 1:
        raise ConfigError(f"input_shape {tuple(input_shape)} is too small: {name} would be empty")


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
        c, h, w = _image_shape(input_shape)
        self.conv1 = nn.Sequential(
            nn.Conv2d(c, 6, 5, padding=conv1_padding), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.conv2 = nn.Sequential(nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2))
        h = _pool_out(_conv_out(_pool_out(_conv_out(h, 5, padding=conv1_padding)), 5))
        w = _pool_out(_conv_out(_pool_out(_conv_out(w, 5, padding=conv1_padding)), 5))
        _require_positive("the conv2 output", min(h, w), input_shape)
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
        c, h, w = _image_shape(input_shape)
        if fc_hidden_layers < 1:
            raise ConfigError("vgg_fedmix: fc_hidden_layers must be >= 1")
        convs: List[nn.Module] = []
        in_ch = c
        for i, out_ch in enumerate(self.CHANNELS):
            parts: List[nn.Module] = [nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.ReLU()]
            if i % 2 == 1:  # a pool after every two convs
                parts.append(nn.MaxPool2d(2))
                h, w = _pool_out(h), _pool_out(w)
                if i >= 3:  # after the second and third pools
                    parts.append(nn.Dropout(dropout))
            convs.append(nn.Sequential(*parts))
            in_ch = out_ch
        _require_positive("the third pool's output", min(h, w), input_shape)
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


# --------------------------------------------------------------------------- ResNets (FedAlign)
def _sliced_channels(channels: int, width: float) -> int:
    """ceil(width * channels), at least 1 and at most ``channels``."""
    if not 0.0 < width <= 1.0:
        raise ValueError(f"width must be in (0, 1]; got {width}")
    # round() first so that e.g. 0.1 * 30 = 3.0000000000000004 gives 3, not 4
    return max(1, min(channels, math.ceil(round(width * channels, 9))))


def _sliced_conv(conv: nn.Conv2d, x: torch.Tensor, out_channels: int) -> torch.Tensor:
    """``conv`` restricted to its first ``x.shape[1]`` inputs and ``out_channels`` outputs."""
    weight = conv.weight[:out_channels, : x.shape[1]]
    bias = conv.bias[:out_channels] if conv.bias is not None else None
    return F.conv2d(x, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def _sliced_bn(bn: nn.BatchNorm2d, x: torch.Tensor) -> torch.Tensor:
    """``bn`` on the first ``x.shape[1]`` channels, with the sliced affine parameters.

    Training mode (or no running statistics): batch statistics, and the
    module's running statistics are left untouched (a slimmed student must not
    overwrite the full network's statistics). Evaluation mode: the sliced
    running statistics. At full width either branch computes exactly what
    ``bn(x)`` computes.
    """
    if not isinstance(bn, nn.BatchNorm2d):  # norm="none": an Identity stands in for BN
        return x
    c = x.shape[1]
    weight = bn.weight[:c] if bn.weight is not None else None
    bias = bn.bias[:c] if bn.bias is not None else None
    if bn.training or bn.running_mean is None:
        # Same kernel as bn(x) in training; the cloned buffers absorb the update.
        mean = bn.running_mean[:c].clone() if bn.running_mean is not None else None
        var = bn.running_var[:c].clone() if bn.running_var is not None else None
        return F.batch_norm(x, mean, var, weight, bias, True, 0.1, bn.eps)
    return F.batch_norm(x, bn.running_mean[:c], bn.running_var[:c], weight, bias, False, 0.0, bn.eps)


def _norm2d(channels: int, norm: str) -> nn.Module:
    """BatchNorm (the papers' ResNets) or nothing (``norm="none"``, for small test models)."""
    return nn.BatchNorm2d(channels) if norm == "batch" else nn.Identity()


class _ResidualBlock(nn.Module):
    """Shared logic of the residual blocks.

    ``forward(x)`` is the ordinary block; ``forward(x, width=w)`` runs it with
    every conv and BN restricted to the first ``ceil(w * C)`` channels of the
    same weights (input channels are taken from ``x``, which the caller has
    already sliced). ``keep_prob`` implements stochastic depth (Huang et al.
    2016, as FedAlign's StochDepth baseline describes it): in training the
    residual branch of the whole batch is kept with probability ``keep_prob``
    (one Bernoulli draw per block per forward, from ``generator`` when one is
    set, else from torch's default generator), at evaluation it is scaled by
    ``keep_prob``. The slimmed path ignores it.
    """

    expansion = 1
    in_channels: int
    out_channels: int

    def __init__(self, norm: str = "batch"):
        super().__init__()
        self.norm = norm
        self.keep_prob = 1.0
        self.generator: Optional[torch.Generator] = None
        self.projection: Optional[nn.Sequential] = None

    def _make_projection(self, in_ch: int, out_ch: int, stride: int) -> None:
        if stride != 1 or in_ch != out_ch:
            self.projection = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=self.norm != "batch"), _norm2d(out_ch, self.norm)
            )

    def residual(self, x: torch.Tensor, width: Optional[float] = None) -> torch.Tensor:
        raise NotImplementedError

    def shortcut(self, x: torch.Tensor, width: Optional[float] = None) -> torch.Tensor:
        if self.projection is None:
            return x
        if width is None:
            return self.projection(x)
        conv, bn = self.projection[0], self.projection[1]
        return _sliced_bn(bn, _sliced_conv(conv, x, _sliced_channels(self.out_channels, width)))

    def forward(self, x: torch.Tensor, width: Optional[float] = None) -> torch.Tensor:
        if width is None and self.keep_prob < 1.0:
            if self.training:
                if float(torch.rand((), generator=self.generator)) >= self.keep_prob:
                    return F.relu(self.shortcut(x))
                return F.relu(self.residual(x) + self.shortcut(x))
            return F.relu(self.keep_prob * self.residual(x) + self.shortcut(x))
        return F.relu(self.residual(x, width) + self.shortcut(x, width))


class BasicBlock(_ResidualBlock):
    """Two 3x3 convs (He et al. 2016); projection shortcut (1x1 conv + BN) when shapes change."""

    expansion = 1

    def __init__(self, in_ch: int, planes: int, stride: int = 1, norm: str = "batch"):
        super().__init__(norm)
        self.in_channels, self.out_channels = in_ch, planes
        bias = norm != "batch"  # without BN a conv keeps its own bias
        self.conv1 = nn.Conv2d(in_ch, planes, 3, stride=stride, padding=1, bias=bias)
        self.bn1 = _norm2d(planes, norm)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=bias)
        self.bn2 = _norm2d(planes, norm)
        self._make_projection(in_ch, planes, stride)

    def residual(self, x, width=None):
        if width is None:
            return self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        mid = _sliced_channels(self.conv1.out_channels, width)
        out = _sliced_channels(self.out_channels, width)
        h = F.relu(_sliced_bn(self.bn1, _sliced_conv(self.conv1, x, mid)))
        return _sliced_bn(self.bn2, _sliced_conv(self.conv2, h, out))


class Bottleneck(_ResidualBlock):
    """1x1 -> 3x3 (stride here) -> 1x1 convs, expansion 4; projection shortcut when shapes change."""

    expansion = 4

    def __init__(self, in_ch: int, planes: int, stride: int = 1, norm: str = "batch"):
        super().__init__(norm)
        out_ch = planes * self.expansion
        self.in_channels, self.out_channels = in_ch, out_ch
        bias = norm != "batch"
        self.conv1 = nn.Conv2d(in_ch, planes, 1, bias=bias)
        self.bn1 = _norm2d(planes, norm)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=bias)
        self.bn2 = _norm2d(planes, norm)
        self.conv3 = nn.Conv2d(planes, out_ch, 1, bias=bias)
        self.bn3 = _norm2d(out_ch, norm)
        self._make_projection(in_ch, out_ch, stride)

    def residual(self, x, width=None):
        if width is None:
            h = F.relu(self.bn1(self.conv1(x)))
            h = F.relu(self.bn2(self.conv2(h)))
            return self.bn3(self.conv3(h))
        mid = _sliced_channels(self.conv1.out_channels, width)
        out = _sliced_channels(self.out_channels, width)
        h = F.relu(_sliced_bn(self.bn1, _sliced_conv(self.conv1, x, mid)))
        h = F.relu(_sliced_bn(self.bn2, _sliced_conv(self.conv2, h, mid)))
        return _sliced_bn(self.bn3, _sliced_conv(self.conv3, h, out))


class ResNet(nn.Module):
    """ResNet with the hooks FedAlign and the baselines of its study need.

    Structure: ``stem`` -> ``blocks`` (one flat ``nn.ModuleList`` of residual
    blocks, stage after stage) -> global average pool -> [dropout] ->
    [``proj_head``] -> ``head`` (linear).

    FedAlign (Sec. 4, Alg. 1, Fig. 2) takes ``f_{L-1}`` and ``f_L``, "the feature
    maps outputted by the last and prior-to-last blocks", and re-runs "Block L
    at a reduced width" omega_S on ``f_{L-1}``: "the channels throughout the
    layers in the sub-block are a omega_S fraction of the original number ...
    via temporary uniform pruning of Block L".

    What "Block L" is: the paper does not say. The authors' code treats it as
    the whole last *stage* (``layer3`` of ResNet-56, ``layer4`` of ResNet-18),
    fed with the previous stage's output whose channels are sliced to the
    same fraction; the paper's own numbers agree: FedAvg 87.3 vs FedAlign 89.1
    MFLOPs on ResNet-56 (Table 5), and re-running the last stage at width 0.25
    costs 1.87 M multiply-accumulates here, re-running only its last residual
    block 0.28 M. Default ``last_block="stage"`` follows that;
    ``last_block="block"`` makes "Block L" the last residual block only.

    * ``forward(x, return_features=True)`` returns ``(logits, feats)`` with
      ``feats["last_block_in"]`` (= f_{L-1}) and ``feats["last_block_out"]``
      (= f_L), both pre-pooling feature maps of the full network, plus
      ``feats["pooled"]`` and, with a projection head, ``feats["projection"]``.
    * ``run_last_block(f, width)`` runs Block L at width ``width`` on ``f``
      (typically ``feats["last_block_in"].detach()``): ``f`` is sliced to its
      first ``ceil(width * C_in)`` channels and every conv/BN of Block L to the
      first ``ceil(width * C)`` channels of the *same* parameters. The output
      has ``ceil(width * C_out)`` channels; at ``width=1.0`` it equals the full
      block's output exactly. BN in the slimmed block uses the sliced affine
      parameters, batch statistics in training mode (without touching the
      running statistics) and the sliced running statistics in eval mode.
      The authors round channel counts with ``make_divisible(C*w, 8)``; for
      the paper's settings (omega_S = 0.25 on 16..512-channel layers) that
      equals ``ceil``.
    * ``forward_width(x, width)``: the whole network at width ``width``
      (GradAug's sub-networks): stem, every block and the head's input
      restricted to the first ``ceil(width * C)`` channels, same BN rule as
      above; the input's colour channels and the class outputs stay whole.
    * Stochastic depth: every block has ``keep_prob``; ``set_stochastic_depth``
      applies the linear decay rule rho_l = 1 - l/L (1 - rho_L) and
      ``set_depth_generator`` the seeded generator the drops are drawn from.
    * ``projection_dim > 0`` (MOON): a two-layer projection head l1 (d -> d),
      ReLU, l2 (d -> projection_dim) between the pooled features and the
      classifier, which then reads the projection (as in MOON's code).
    * ``norm="none"`` drops every BatchNorm (convs then carry biases) and
      ``dropout > 0`` puts a dropout before the head: the small test models'
      switches.

    Shortcuts are projections (1x1 conv + BN) where the shape changes.
    """

    def __init__(
        self,
        input_shape,
        num_classes: int,
        block: type,
        stage_blocks: Sequence[int],
        stage_planes: Sequence[int],
        stem: str = "cifar",
        stem_channels: int = 16,
        last_block: str = "stage",
        norm: str = "batch",
        dropout: float = 0.0,
        projection_dim: int = 0,
    ):
        super().__init__()
        c, h, w = _image_shape(input_shape)
        if norm not in ("batch", "none"):
            raise ConfigError(f"norm must be 'batch' or 'none'; got {norm!r}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1); got {dropout}")
        if projection_dim < 0:
            raise ConfigError(f"projection_dim must be >= 0 (0 = no projection head); got {projection_dim}")
        bias = norm != "batch"
        if stem == "cifar":
            self.stem = nn.Sequential(
                nn.Conv2d(c, stem_channels, 3, padding=1, bias=bias),
                _norm2d(stem_channels, norm),
                nn.ReLU(),
            )
        elif stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(c, stem_channels, 7, stride=2, padding=3, bias=bias),
                _norm2d(stem_channels, norm),
                nn.ReLU(),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        else:
            raise ConfigError(f"stem must be 'cifar' or 'imagenet'; got {stem!r}")
        if last_block not in ("stage", "block"):
            raise ConfigError(f"last_block must be 'stage' or 'block'; got {last_block!r}")

        blocks: List[nn.Module] = []
        self.block_stage: List[int] = []
        in_ch = stem_channels
        for s, (n, planes) in enumerate(zip(stage_blocks, stage_planes)):
            for i in range(n):
                stride = 2 if (s > 0 and i == 0) else 1
                b = block(in_ch, planes, stride, norm)
                blocks.append(b)
                self.block_stage.append(s)
                in_ch = b.out_channels
        self.blocks = nn.ModuleList(blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.proj_head: Optional[nn.Sequential] = None
        if projection_dim > 0:
            self.proj_head = nn.Sequential(nn.Linear(in_ch, in_ch), nn.ReLU(), nn.Linear(in_ch, projection_dim))
        self.head = nn.Linear(projection_dim or in_ch, num_classes)
        self.feature_dim = in_ch
        self.last_block = last_block
        if last_block == "stage":
            self.last_block_start = self.block_stage.index(self.block_stage[-1])
        else:
            self.last_block_start = len(self.blocks) - 1
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    # -- FedAlign hooks
    def last_blocks(self) -> nn.ModuleList:
        """The residual blocks that make up "Block L"."""
        return self.blocks[self.last_block_start :]  # type: ignore[return-value]

    @property
    def last_block_channels(self) -> Tuple[int, int]:
        """(channels of f_{L-1}, channels of f_L) at full width."""
        first = self.blocks[self.last_block_start]
        return first.in_channels, self.blocks[-1].out_channels

    def _classify(self, h: torch.Tensor, feats: Optional[dict] = None) -> torch.Tensor:
        """Pooled features -> [dropout] -> [projection head] -> logits."""
        pooled = torch.flatten(self.pool(h), 1)
        z = self.dropout(pooled) if self.dropout is not None else pooled
        if self.proj_head is not None:
            z = self.proj_head(z)
        if feats is not None:
            feats["pooled"] = pooled
            if self.proj_head is not None:
                feats["projection"] = z
        return self.head(z)

    def forward(self, x: torch.Tensor, return_features: bool = False):
        h = self.stem(x)
        last_in = h
        for i, b in enumerate(self.blocks):
            if i == self.last_block_start:
                last_in = h
            h = b(h)
        feats = {"last_block_in": last_in, "last_block_out": h} if return_features else None
        logits = self._classify(h, feats)
        return (logits, feats) if return_features else logits

    def run_last_block(self, features_in: torch.Tensor, width: float = 1.0, return_input: bool = False):
        """Block L at width ``width`` on ``features_in`` (full-width f_{L-1} or already sliced).

        Returns the output feature map, or ``(sliced_input, output)`` with
        ``return_input=True`` (the sliced input is what FedAlign's X_S pairs
        with the student output in the authors' code).
        """
        c_in = self.last_block_channels[0]
        if features_in.shape[1] not in (c_in, _sliced_channels(c_in, width)):
            raise ValueError(
                f"features_in has {features_in.shape[1]} channels; expected {c_in} "
                f"(full) or {_sliced_channels(c_in, width)} (sliced to width {width})"
            )
        x = features_in[:, : _sliced_channels(c_in, width)]
        h = x
        for b in self.last_blocks():
            h = b(h, width=width)
        return (x, h) if return_input else h

    def forward_width(self, x: torch.Tensor, width: float) -> torch.Tensor:
        """Logits of the whole network slimmed to ``width`` (GradAug's sub-network F_{theta^omega}).

        Every layer keeps the first ``ceil(width * C)`` of its channels (the
        "uniform pruning" of slimmable networks); the first conv still reads
        every input channel and the head still gives every class. Dropout
        applies as in ``forward``; stochastic depth does not (the slimmed path
        of a block ignores it). With a projection head there is no slimmed
        reading, so it is refused.
        """
        if self.proj_head is not None:
            raise ValueError("forward_width is not defined for a model with a projection head")
        conv, bn = self.stem[0], self.stem[1]
        h = F.relu(_sliced_bn(bn, _sliced_conv(conv, x, _sliced_channels(conv.out_channels, width))))
        for layer in list(self.stem)[3:]:  # the ImageNet stem's max-pool
            h = layer(h)
        for b in self.blocks:
            h = b(h, width=width)
        pooled = torch.flatten(self.pool(h), 1)
        if self.dropout is not None:
            pooled = self.dropout(pooled)
        c = pooled.shape[1]
        return F.linear(pooled, self.head.weight[:, :c], self.head.bias)

    def set_stochastic_depth(self, final_keep_prob: float) -> None:
        """Linear decay rho_l = 1 - (l / L) (1 - rho_L) over the L residual blocks (l = 1..L)."""
        if not 0.0 < final_keep_prob <= 1.0:
            raise ValueError("final_keep_prob must be in (0, 1]")
        n = len(self.blocks)
        for l, b in enumerate(self.blocks, start=1):
            b.keep_prob = 1.0 - l / n * (1.0 - final_keep_prob)

    def set_depth_generator(self, generator: Optional[torch.Generator]) -> None:
        """The CPU generator every block draws its stochastic-depth Bernoulli from (None: torch's default)."""
        for b in self.blocks:
            b.generator = generator

    def layers(self):
        return (
            [("stem", self.stem)]
            + [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)]
            + ([("proj_head", self.proj_head)] if self.proj_head is not None else [])
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
        c, h, w = _image_shape(input_shape)
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
            h, w = _pool_out(h), _pool_out(w)
        _require_positive("the fourth pool's output", min(h, w), input_shape)
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
        c, h, w = _image_shape(input_shape)
        c1, c2 = (int(v) for v in channels)
        self.conv1 = nn.Sequential(nn.Conv2d(c, c1, 5), nn.MaxPool2d(2), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(c1, c2, 5), nn.Dropout2d(dropout), nn.MaxPool2d(2), nn.ReLU())
        h = _pool_out(_conv_out(_pool_out(_conv_out(h, 5)), 5))
        w = _pool_out(_conv_out(_pool_out(_conv_out(w, 5)), 5))
        _require_positive("the conv2 output", min(h, w), input_shape)
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
        c, h, w = _image_shape(input_shape)
        if width_multiplier <= 0:
            raise ConfigError("mobilenet: width_multiplier must be > 0")

        def scaled(ch: int) -> int:
            return max(1, int(round(ch * width_multiplier)))

        in_ch = scaled(32)
        self.stem = nn.Sequential(
            nn.Conv2d(c, in_ch, 3, stride=stem_stride, padding=1, bias=False), nn.BatchNorm2d(in_ch), nn.ReLU()
        )
        h, w = _conv_out(h, 3, stem_stride, 1), _conv_out(w, 3, stem_stride, 1)
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
            h, w = _conv_out(h, 3, stride, 1), _conv_out(w, 3, stride, 1)
        _require_positive("the last separable layer's output", min(h, w), input_shape)
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
        c, h, w = _image_shape(input_shape)
        (c1, c2), (k1, k2), (p1, p2) = (tuple(int(v) for v in t) for t in (channels, kernel_sizes, padding))
        self.conv1 = nn.Sequential(nn.Conv2d(c, c1, k1, padding=p1, bias=bias), nn.ReLU(), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(c1, c2, k2, padding=p2, bias=bias), nn.ReLU(), nn.MaxPool2d(2))
        h = _pool_out(_conv_out(_pool_out(_conv_out(h, k1, padding=p1)), k2, padding=p2))
        w = _pool_out(_conv_out(_pool_out(_conv_out(w, k1, padding=p1)), k2, padding=p2))
        _require_positive("the conv2 output", min(h, w), input_shape)
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


@register_model("resnet56")
def resnet56(input_shape, num_classes, block: str = "bottleneck", last_block: str = "stage", projection_dim: int = 0):
    """ResNet-56 for 32x32 inputs: stem 3x3 conv (16), three stages at 16/32/64 planes, strides 1/2/2.

    FedAlign uses "ResNet56 (as implemented in FedML)": Bottleneck blocks, 6 per
    stage (3 * 6 * 3 + 2 = 56 layers), planes 16/32/64 with expansion 4
    (final features 256). Its parameter count, 0.61 M with 100 classes, is the
    one FedAlign reports (Table 5). ``block="basic"`` gives He et al.'s
    original CIFAR ResNet-56: 9 basic blocks per stage, 16/32/64 channels
    (0.86 M with projection shortcuts). ``projection_dim=256`` adds MOON's
    projection head (FedAlign Sec. 3.2: "a two-layer projection layer is added
    to the model for MOON").
    """
    kw = dict(last_block=last_block, projection_dim=projection_dim)
    if block == "bottleneck":
        return ResNet(input_shape, num_classes, Bottleneck, (6, 6, 6), (16, 32, 64), "cifar", 16, **kw)
    if block == "basic":
        return ResNet(input_shape, num_classes, BasicBlock, (9, 9, 9), (16, 32, 64), "cifar", 16, **kw)
    raise ConfigError(f"resnet56: block must be 'bottleneck' or 'basic'; got {block!r}")


@register_model("resnet18")
def resnet18(input_shape, num_classes, stem: str = "imagenet", last_block: str = "stage", projection_dim: int = 0,
             norm: str = "batch"):
    """ResNet-18 (He et al.): 4 stages of 2 basic blocks, 64/128/256/512 channels.

    ``stem="imagenet"`` (default, as in FedAlign's code for ImageNet-200):
    7x7/2 conv + 3x3/2 max-pool, so 64x64 inputs end at 2x2 and 224x224 at
    7x7. ``stem="cifar"``: a 3x3/1 conv and no pool. ``projection_dim``: MOON's head.
    ``norm="none"`` drops BatchNorm (convs keep biases): what batched clients
    (``--clients-at-once``) need.
    """
    return ResNet(input_shape, num_classes, BasicBlock, (2, 2, 2, 2), (64, 128, 256, 512), stem, 64, last_block,
                  norm=norm, projection_dim=projection_dim)


@register_model("resnet_digits")
def resnet_digits(input_shape, num_classes, width: int = 8, blocks: int = 1, norm: str = "batch",
                  dropout: float = 0.0, projection_dim: int = 0, last_block: str = "stage"):
    """A ResNet sized for 8x8 digits: the FedAlign family's methods on a laptop and in tests.

    3x3 stem (``width`` channels), three stages of ``blocks`` basic blocks at
    width / 2 width / 4 width channels, strides 1/2/2 (8x8 -> 4x4 -> 2x2), so it
    has a last stage to slim (FedAlign), blocks to drop (StochDepth), widths to
    sample (GradAug) and, with ``projection_dim``, MOON's head. ``norm`` and
    ``dropout`` as in :class:`ResNet`. About 20 K parameters at the defaults.
    """
    if width < 1 or blocks < 1:
        raise ConfigError(f"resnet_digits: width and blocks must be >= 1; got {width}, {blocks}")
    return ResNet(input_shape, num_classes, BasicBlock, (blocks,) * 3, (width, 2 * width, 4 * width), "cifar",
                  width, last_block, norm=norm, dropout=dropout, projection_dim=projection_dim)


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
