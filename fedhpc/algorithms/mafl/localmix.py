"""LocalMix (FedMix paper baseline): FedAvg with mixup inside each client's own data.

Every mini-batch is mixed with a random permutation of itself:

    x~ = (1-l) x_i + l x_pi(i),   loss = (1-l) L(f(x~), y_i) + l L(f(x~), y_pi(i))

The paper gives no l for LocalMix: Table 8 lists l for NaiveMix and FedMix only,
and Sec. 3.1 describes mixup's l as "chosen from the beta distribution for each
training step", with no alpha reported. Default: a fixed l = 0.1, this repository's
choice (the size of NaiveMix / FedMix's Table 8 values), not a value from the paper;
``--mix-alpha A > 0`` draws l ~ Beta(A, A) per batch instead, as mixup does (state
the A used). The draws (permutation and l) are seeded by (seed, round, client),
independent of ranks. ``prox_mu`` > 0 gives "FedProx + LocalMix". Nothing but
parameters is exchanged. Text models mix in embedding space
(:class:`fedhpc.algorithms.mafl.mixing.MixSpace`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...batched import add_proximal_terms
from ...data.base import host_to_device
from ...errors import ConfigError
from .. import register_algorithm
from ..base import Algorithm, derive_seed
from ..fedprox import add_proximal_term
from .mixing import MixSpace, batched_mixup_loss, mixup_loss, permuted_rows


@dataclass
class LocalMixOptions:
    lam: float = field(default=0.1, metadata={"help": "fixed mixing ratio lambda (used when --mix-alpha is 0)"})
    mix_alpha: float = field(default=0.0, metadata={
        "help": "draw lambda ~ Beta(alpha, alpha) per batch instead of the fixed --lam (0 = fixed)"})
    prox_mu: float = field(default=0.0, metadata={"help": "FedProx coefficient mu (0 = off)"})

    def validate(self):
        if not 0 <= self.lam <= 1:
            raise ConfigError(f"--lam must be in [0, 1], got {self.lam}")
        if not self.mix_alpha >= 0:
            raise ConfigError(f"--mix-alpha must be >= 0 (0 = fixed --lam), got {self.mix_alpha}")
        if not self.prox_mu >= 0:
            raise ConfigError(f"--prox-mu must be >= 0 (0 = off), got {self.prox_mu}")


def draw_lambda(ctx, options) -> float:
    """The batch's mixing ratio: fixed, or Beta(alpha, alpha) from the client's own stream."""
    if options.mix_alpha <= 0:
        return options.lam
    if "lam_rng" not in ctx.extra:
        ctx.extra["lam_rng"] = np.random.default_rng(derive_seed(ctx.cfg.seed, "mix_lambda", ctx.round.index, ctx.cid))
    return float(ctx.extra["lam_rng"].beta(options.mix_alpha, options.mix_alpha))


@register_algorithm("localmix")
class LocalMix(Algorithm):
    """FedAvg with mixup within each client's local data (FedMix paper baseline)."""

    Options = LocalMixOptions
    #: plain SGD steps on ``loss``; batched_loss is the same loss for K clients (fedhpc.batched)
    batchable = True

    def setup(self):
        self.options = self.options or LocalMixOptions()
        self.space = MixSpace(self.data.task, self.data.num_classes)
        self.space.check(self.model, self.model_named)

    def loss(self, model, x, y, ctx):
        gen = ctx.extra.setdefault("perm_gen", ctx.generator("local_mix"))
        perm = host_to_device(torch.randperm(x.shape[0], generator=gen), x.device)
        lam = draw_lambda(ctx, self.options)
        xin = self.space.lift(model, x)
        yin = self.space.labels(y, xin.dtype if xin.is_floating_point() else torch.float32)
        loss = mixup_loss(self.space.f(model), xin, yin, xin[perm], yin[perm], lam)
        return add_proximal_term(loss, self, model, self.options.prox_mu, ctx)

    def batched_loss(self, group, x, y, weight):
        """``loss`` for K clients (fedhpc.batched): each active client draws its permutation of
        its real rows and its lambda from its own streams, in the order ``loss`` draws them;
        padded rows map to themselves (weight 0, so they contribute nothing)."""
        k, b = x.shape[0], x.shape[1]
        perm = torch.arange(b).repeat(k, 1)  # made on the host, sent in one copy
        lam = torch.zeros(k, dtype=torch.float64)
        for i, ctx in enumerate(group.ctxs):
            if not group.active[i]:
                continue
            gen = ctx.extra.setdefault("perm_gen", ctx.generator("local_mix"))
            n = group.real[i]
            perm[i, :n] = torch.randperm(n, generator=gen)
            lam[i] = draw_lambda(ctx, self.options)
        yin = self.space.labels(y, x.dtype)
        x2, y2 = permuted_rows(x, yin, perm)
        lam = host_to_device(lam, x.device)
        if self.options.mix_alpha <= 0:
            lam = self.options.lam  # a float, exactly as loss uses it
        loss = batched_mixup_loss(group.forward, x, yin, x2, y2, lam, weight)
        return add_proximal_terms(loss, group, self, self.options.prox_mu)  # per-client anchors
