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
(:class:`fedhpc.algorithms.mafl.mixing.MixSpace`).

Ledger: parameters as FedAvg; "mean_data" up once per refresh (all clients'
means, booked once by rank 0 since the ledger is summed over ranks) and down once
per refresh and client, the first round it is sampled after the refresh (the
external entries it receives): Alg. 1 sends (Xg, Yg) only "if updated", and the
means are "only exchanged at the beginning of the first communication round"
(Sec. 3.4), so a client keeps what it received. With ``--mean-refresh every_round``
that is every round the client is sampled. Which table each client holds is part
of the checkpoint (:meth:`NaiveMix.state_dict`), so a resumed run books what the
uninterrupted one does. What the client holds of those entries is a view of the
exchanged table (:class:`fedhpc.exchanges.mean_data.ExternalMeans`), so its cost
does not grow with the number of clients.

FedMix (:mod:`fedhpc.algorithms.mafl.fedmix`) is this class with the loss of Eq. 5.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...batched import add_proximal_terms, weighted_task_loss
from ...data.base import host_to_device
from ...errors import ConfigError
from ...exchanges.mean_data import MeanDataExchange, MeanDataOptions
from .. import register_algorithm
from ..base import Algorithm, task_loss
from ..fedprox import add_proximal_term
from .mixing import MixSpace, batched_mixup_loss, naivemix_loss, one_hot


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
    #: plain SGD steps on ``loss``; batched_loss is the same loss for K clients (fedhpc.batched)
    batchable = True

    def setup(self):
        self.options = self.options or self.Options()
        self.space = MixSpace(self.data.task, self.data.num_classes)
        self.space.check(self.model, self.model_named)
        self.exchange = MeanDataExchange(self, self.options)

    def round_begin(self, rnd):
        self.exchange.round_begin(rnd)  # collective: every rank, every round

    def download(self, ctx):
        super().download(ctx)
        ctx.extra["means"] = self.exchange.download(ctx, self.options.mix_with)
        ctx.extra["select_gen"] = ctx.generator("mean_select")

    def state_dict(self):
        # which mean table each client already holds: the download ledger of later rounds
        return {"mean_data": self.exchange.state_dict()}

    def load_state_dict(self, state):
        self.exchange.load_state_dict(state.get("mean_data") or {})

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
        return add_proximal_term(loss, self, model, self.options.prox_mu, ctx)

    # ------------------------------------------------------------ K clients at once (fedhpc.batched)
    def batched_mix_loss(self, forward, x, y, xbar, ybar, lam, weight):
        """``mix_loss`` for K clients (K,): inputs (K, B, ...), soft labels (K, B, C), means with
        1 or B rows per client, ``weight`` (K, B) the per-row weights (1/n_real, 0 on padding)."""
        return batched_mixup_loss(forward, x, y, xbar, ybar, lam, weight)

    def batched_means(self, group, x):
        """Each active client's draw of mean entries for this step, from its own stream, as
        ``loss`` draws them: (K, n, ...) inputs, (K, n, C) labels (n = 1, or B per sample) and,
        per client, whether it had any entry to draw from. Inactive clients draw nothing."""
        k, b = x.shape[0], x.shape[1]
        rows = 1 if self.options.select == "batch" else b
        xbar = torch.zeros((k, rows) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
        ybar = torch.zeros((k, rows, self.data.num_classes), dtype=x.dtype, device=x.device)
        has = [False] * k
        for i, ctx in enumerate(group.ctxs):
            means = ctx.extra["means"]
            if not group.active[i] or len(means) == 0:
                continue
            n = 1 if self.options.select == "batch" else group.real[i]
            pick = torch.randint(len(means), (n,), generator=ctx.extra["select_gen"])
            xsel, ysel = means.take(pick)
            xbar[i, :n] = xsel.to(x.device, x.dtype)
            ybar[i, :n] = ysel.to(x.device, x.dtype)
            has[i] = True
        return xbar, ybar, has

    def batched_loss(self, group, x, y, weight):
        if self.options.lam == 0:
            loss = weighted_task_loss(group.forward(x), y, weight)
        else:
            xbar, ybar, has = self.batched_means(group, x)
            yin = one_hot(y, self.data.num_classes, x.dtype)
            loss = self.batched_mix_loss(group.forward, x, yin, xbar, ybar, self.options.lam, weight)
            if any(a and not h for a, h in zip(group.active, has)):
                # a client with nothing external to mix with trains on CE, as in loss
                has_t = host_to_device(torch.tensor(has), x.device)
                loss = torch.where(has_t, loss, weighted_task_loss(group.forward(x), y, weight))
        return add_proximal_terms(loss, group, self, self.options.prox_mu)  # per-client anchors
