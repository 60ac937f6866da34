"""NaiveMix (FedMix paper, Eq. 1): mixup of local samples with other clients' mean data under MAFL.

Round: every rank takes part in the mean-data exchange (:mod:`fedhpc.exchanges.mean_data`,
once before round 1 by default); each sampled client receives the entries of
(Xg, Yg) that hold none of its own data ("never mix a client with its own
mean"), and trains on

    (1-l) L(f((1-l) x_i + l xbar), y_i) + l L(f((1-l) x_i + l xbar), ybar)

with one entry (xbar, ybar) drawn per mini-batch (Alg. 2; ``--select sample``
draws one per sample instead; ``--mix-with all|own`` lets a client use its own
means too, or only them, as App. D's "Mixup w/ local means" ablation), plus (prox_mu/2)||w - w_global||^2 when prox_mu > 0
(the paper's "FedProx + NaiveMix"). Text models mix in embedding space
(:class:`fedhpc.algorithms.mixing.MixSpace`).

Ledger: parameters as FedAvg; "mean_data" up once per refresh (all clients'
means, booked once by rank 0 since the ledger is summed over ranks) and down per
sampled client per round (the external entries it receives). What the client
holds of those entries is a view of the exchanged table
(:class:`fedhpc.exchanges.mean_data.ExternalMeans`), so its cost does not grow
with the number of clients.

FedMix (:mod:`fedhpc.algorithms.fedmix`) is this class with the loss of Eq. 5.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..exchanges.mean_data import MeanDataExchange, MeanDataOptions
from . import register_algorithm
from .base import Algorithm, task_loss
from .fedprox import add_proximal_term
from .mixing import MixSpace, naivemix_loss


@dataclass
class NaiveMixOptions(MeanDataOptions):
    lam: float = field(default=0.1, metadata={
        "help": "mixing ratio lambda (Table 8: FEMNIST 0.2, CIFAR-10 0.1, CIFAR-100 0.1)"})
    select: str = field(default="batch", metadata={
        "help": "draw one mean entry per mini-batch (Alg. 2) or per sample"})
    prox_mu: float = field(default=0.0, metadata={
        "help": "FedProx coefficient mu added to the local loss (0 = off; Table 8: 0.1 / 0.1 / 0.01)"})
    mix_with: str = field(default="others", metadata={
        "help": "mean entries a client mixes with: others (never its own, the paper), all, or own (App. D ablation)"})

    def validate(self):
        super().validate()
        if not 0 <= self.lam <= 1:
            raise ConfigError(f"--lam must be in [0, 1], got {self.lam}")
        if self.select not in ("batch", "sample"):
            raise ConfigError(f"--select must be batch or sample, got {self.select!r}")
        if not self.prox_mu >= 0:
            raise ConfigError(f"--prox-mu must be >= 0 (0 = off), got {self.prox_mu}")
        if self.mix_with not in ("others", "all", "own"):
            raise ConfigError(f"--mix-with must be others, all or own, got {self.mix_with!r}")


@register_algorithm("naivemix")
class NaiveMix(Algorithm):
    """MAFL NaiveMix (FedMix paper Eq. 1): mixup of local data with other clients' means."""

    Options = NaiveMixOptions
    ledger_kinds = ("parameters", "mean_data")

    def setup(self):
        self.options = self.options or self.Options()
        self.space = MixSpace(self.data.task, self.data.num_classes)
        self.space.check(self.model)
        self.exchange = MeanDataExchange(self, self.options)

    def round_begin(self, rnd):
        self.exchange.round_begin(rnd)  # collective: every rank, every round

    def download(self, ctx):
        super().download(ctx)
        ctx.extra["means"] = self.exchange.download(ctx, self.options.mix_with)
        ctx.extra["select_gen"] = ctx.generator("mean_select")

    def mix_loss(self, f, x, y, xbar, ybar, lam):
        """The mixing objective on one batch in mixing space (FedMix overrides this)."""
        return naivemix_loss(f, x, y, xbar, ybar, lam)

    def loss(self, model, x, y, ctx):
        means = ctx.extra["means"]
        if len(means) == 0 or self.options.lam == 0:
            loss = task_loss(model(x), y)  # nothing external to mix with
        else:
            n = 1 if self.options.select == "batch" else x.shape[0]
            # The same draw as over a copied external set: take() maps it to the same entry.
            pick = torch.randint(len(means), (n,), generator=ctx.extra["select_gen"])
            xsel, ysel = means.take(pick)
            xbar = self.space.lift_means(model, xsel)
            xin = self.space.lift(model, x)
            ybar = ysel.to(xbar.dtype)
            yin = self.space.labels(y, xbar.dtype)
            loss = self.mix_loss(self.space.f(model), xin, yin, xbar, ybar, self.options.lam)
        return add_proximal_term(loss, self, model, self.options.prox_mu)
