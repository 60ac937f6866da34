"""GradAug (Yang, Zhu & Chen, NeurIPS 2020) as a local regulariser, as FedAlign's study runs it (Eq. 2).

    L_GA = L_CE(F(x), y) + mu * sum_{i=1..n} L_KD(F_{w_i}(T_i(x)), F(x))                 (Eq. 2)

F_{w_i}: the network slimmed to width w_i ~ U(omega^b, 1) (every layer keeps its
first ceil(w C) channels: :meth:`fedhpc.models.resnet.ResNet.forward_width`); T_i: a
random resolution (bilinear resize by a scale drawn from ``scales``); L_KD: the KL
divergence KL(softmax(F(x)) || softmax(F_{w_i}(T_i x))), batch mean, with the full
network's output *detached* (the sub-networks learn from it, it does not move
towards them). The study's settings: n = 2, omega^b = 0.8, mu = 1.75 (mu 2.0 for
n = 1), random resolution. ``scales`` default 1, 0.875, 0.75, 0.625 is the
authors' {32, 28, 24, 20} on 32x32 CIFAR, as fractions so any input size works.

Readings chosen: widths are n independent draws (the paper); ``sandwich=True`` is
the GradAug code's rule (the first sub-network at omega^b, n - 1 draws). The KL
(the paper's word) and the GradAug code's soft cross-entropy differ by the
teacher's entropy, a constant: same gradients. Slim passes use batch statistics
and leave BatchNorm's running statistics to the full network. Stream rule: per
batch, from the ``"gradaug"`` generator of (seed, round, client), first the n widths
(:func:`~fedhpc.algorithms.local_learning.local_reg.draw_widths`), then the n scale indices
(:func:`~fedhpc.algorithms.local_learning.local_reg.draw_scales`); widths in decreasing order,
scale i goes with width i.

Batched clients (``--clients-at-once K``, :mod:`fedhpc.batched`): the full network's forward is one
grouped pass over the K clients; each client's sub-networks (its own widths, its own resolutions:
layers and inputs of other sizes per client) run client by client on its real rows under its own
weights, their dropout masks from its own stream, as FedAlign's slimmed block does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...batched import client_stream, client_weights, weighted_task_loss
from ...errors import ConfigError
from .. import register_algorithm
from ..base import task_loss
from .local_reg import (LocalRegAlgorithm, LocalRegOptions, draw_scales, draw_widths, parse_scales,
                        require_resnet, resize)


@dataclass
class GradAugOptions(LocalRegOptions):
    mu: float = field(default=1.75, metadata={"help": "weight mu of the distillation terms (paper 1.75 for n=2)",
                                                 "method_specific": True})
    num_subnets: int = field(default=2, metadata={"help": "number n of sub-networks per batch (paper 2)"})
    min_width: float = field(default=0.8, metadata={"help": "width lower bound omega^b (paper 0.8)"})
    scales: str = field(default="1.0,0.875,0.75,0.625", metadata={
        "help": "resolution scales T_i is drawn from (32,28,24,20 on 32x32)"})
    sandwich: bool = field(default=False, metadata={
        "help": "GradAug code's rule: the first sub-network at --min-width, the others drawn"})

    def validate(self):
        super().validate()
        if not self.mu >= 0:
            raise ConfigError(f"--mu must be >= 0, got {self.mu}")
        if self.num_subnets < 1:
            raise ConfigError(f"--num-subnets must be >= 1, got {self.num_subnets}")
        if not 0 < self.min_width <= 1:
            raise ConfigError(f"--min-width must be in (0, 1], got {self.min_width}")
        parse_scales(self.scales)


@register_algorithm("gradaug")
class GradAug(LocalRegAlgorithm):
    """FedAvg whose clients distil the full network into random slimmed, resized sub-networks."""

    Options = GradAugOptions
    auto_model_kind = "residual"
    #: its own opt-in: batched_loss is ``loss`` for K clients, sub-networks client by client
    batchable = True

    def setup(self):
        super().setup()
        require_resnet(self, "forward_width")
        if getattr(self.model, "proj_head", None) is not None:
            raise ConfigError("gradaug slims the whole network, which has no reading for a projection head: "
                              "drop --model-opt projection_dim")
        self.scales = parse_scales(self.options.scales)

    def probe_forward(self, model, x):
        model(x)  # and the smallest sub-network: narrowest width at the lowest resolution
        model.forward_width(resize(x, min(self.scales)), self.options.min_width)

    def loss(self, model, x, y, ctx):
        logits = model(x)
        return self.add_subnet_terms(task_loss(logits, y), model, x, logits, ctx)

    def add_subnet_terms(self, loss, model, x, logits, ctx):
        """``loss`` + mu * sum_i KL(F(x) || F_{w_i}(T_i x)) (Eq. 2) over the n sub-networks the client's
        stream draws for this batch: widths, then scales (the stream rule above)."""
        o = self.options
        gen = ctx.extra.setdefault("gradaug_gen", ctx.generator("gradaug"))
        widths = draw_widths(gen, o.num_subnets, o.min_width, o.sandwich)
        scales = draw_scales(gen, o.num_subnets, self.scales)
        teacher = F.softmax(logits.detach(), dim=-1)
        for w, s in zip(widths, scales):
            student = F.log_softmax(model.forward_width(resize(x, s), w), dim=-1)
            loss = loss + o.mu * F.kl_div(student, teacher, reduction="batchmean")
        return loss

    def batched_loss(self, group, x, y, weight):
        """``loss`` for K clients (fedhpc.batched): the full forward grouped; each active client draws
        its widths and scales from its own stream and runs its sub-networks on its real rows under its
        own weights (a client masked out of the step draws and runs nothing: its loss is 0)."""
        logits = group.forward(x)
        ce = weighted_task_loss(logits, y, weight)
        losses = []
        for i, (ctx, n) in enumerate(zip(group.ctxs, group.real)):
            if n == 0:
                losses.append(ce[i])
                continue
            with client_weights(self.model, group.params, i) as model, client_stream(group, i, x.device):
                losses.append(self.add_subnet_terms(ce[i], model, x[i, :n], logits[i, :n], ctx))
        return torch.stack(losses)
