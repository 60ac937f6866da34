"""The ResNets of FedAlign and its study (ResNet-56 for CIFAR, ResNet-18 for ImageNet-200, a
digits-sized one for laptops and tests), with the slicing FedAlign and GradAug need: a last
stage run at a fraction of its width, and any stage at a sampled width.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from . import register_model
from .shapes import image_shape


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
    ``keep_prob``. The slimmed path ignores it. ``client_keep``: K clients' rows folded into one
    batch (``--clients-at-once``, :mod:`fedhpc.batched`) each keep or drop the branch by their own
    draw, made before the forward: a (K,) 0/1 tensor on the batch's device, or True when every
    client keeps it (None: the single draw above).
    """

    expansion = 1
    in_channels: int
    out_channels: int

    def __init__(self, norm: str = "batch"):
        super().__init__()
        self.norm = norm
        self.keep_prob = 1.0
        self.generator: Optional[torch.Generator] = None
        self.client_keep: Union[torch.Tensor, bool, None] = None
        self.projection: Optional[nn.Sequential] = None

    def _make_projection(self, in_ch: int, out_ch: int, stride: int) -> None:
        if stride != 1 or in_ch != out_ch:
            self.projection = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=self.norm != "batch"), _norm2d(out_ch, self.norm)
            )

    def residual(self, x: torch.Tensor, width: Optional[float] = None) -> torch.Tensor:
        raise NotImplementedError

    def draws_keep(self, generator: Optional[torch.Generator]) -> bool:
        """One stochastic-depth draw: whether the branch is kept (Bernoulli(keep_prob) from
        ``generator``; the batched path draws each client's with this too)."""
        return float(torch.rand((), generator=generator)) < self.keep_prob

    def residual_branch(self) -> List[str]:
        """The submodules ``residual`` runs (all but the projection shortcut): what a dropped block
        leaves untouched."""
        return [name for name, _ in self.named_children() if name != "projection"]

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
                if self.client_keep is True:
                    return F.relu(self.residual(x) + self.shortcut(x))
                if self.client_keep is not None:
                    keep = self.client_keep
                    # 1 * r + s == r + s and 0 * r + s == s: each client's rows as its own draw gives them
                    rows = keep.to(dtype=x.dtype).repeat_interleave(x.shape[0] // len(keep))
                    return F.relu(rows.view((-1,) + (1,) * (x.dim() - 1)) * self.residual(x) + self.shortcut(x))
                if not self.draws_keep(self.generator):
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
        c, h, w = image_shape(input_shape)
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


# --------------------------------------------------------------------------- registry
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
                  dropout: float = 0.0, projection_dim: int = 0, last_block: str = "stage", stem: str = "cifar"):
    """A ResNet sized for 8x8 digits: the FedAlign family's methods on a laptop and in tests.

    3x3 stem (``width`` channels), three stages of ``blocks`` basic blocks at
    width / 2 width / 4 width channels, strides 1/2/2 (8x8 -> 4x4 -> 2x2), so it
    has a last stage to slim (FedAlign), blocks to drop (StochDepth), widths to
    sample (GradAug) and, with ``projection_dim``, MOON's head. ``norm`` and
    ``dropout`` as in :class:`ResNet`. About 20 K parameters at the defaults.
    ``stem="imagenet"`` (7x7 stride-2 convolution and a stride-2 max-pool) brings 28x28
    MNIST to 7x7 first: the same network on mnist5k at about a tenth of the 3x3 stem's
    compute (``resnet_mnist``, mnist5k's residual model).
    """
    if width < 1 or blocks < 1:
        raise ConfigError(f"resnet_digits: width and blocks must be >= 1; got {width}, {blocks}")
    return ResNet(input_shape, num_classes, BasicBlock, (blocks,) * 3, (width, 2 * width, 4 * width), stem,
                  width, last_block, norm=norm, dropout=dropout, projection_dim=projection_dim)


@register_model("resnet_mnist")
def resnet_mnist(input_shape, num_classes, width: int = 8, blocks: int = 1, norm: str = "batch",
                 dropout: float = 0.0, projection_dim: int = 0, last_block: str = "stage"):
    """:func:`resnet_digits` with the ImageNet stem, for 28x28 inputs (mnist5k's residual network):
    28x28 -> 7x7 in the stem, then 7x7 -> 4x4 -> 2x2 as digits' 8x8 -> 4x4 -> 2x2."""
    return resnet_digits(input_shape, num_classes, width, blocks, norm, dropout, projection_dim, last_block,
                         stem="imagenet")
