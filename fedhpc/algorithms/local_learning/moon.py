"""MOON, model-contrastive federated learning (Li, He & Song, CVPR 2021), as FedAlign's study runs it.

Each client minimises

    L = L_CE(F(x), y) + mu * l_con,
    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )

z, z_glob, z_prev: the projection-head outputs of the model being trained, of the
round's global model and of this client's model from the last round it trained
(MOON Eqs. 3-4; under a channel model, a device that missed the broadcast contrasts
with the model it kept and starts from instead, ``Algorithm.anchor_state``); sim is
the cosine similarity; l_con is averaged over the batch.
FedAlign's study: "a two-layer projection layer is added to the model", tau 0.5,
mu 1 (MOON's official code: l1 (d -> d), ReLU, l2 (d -> 256), the classifier reading
the projection): build the model with ``--model-opt projection_dim=256``.

The previous model of every client lives in the client-state store (one flat model
per client that has trained: bounded memory, spilled to disk past
``--client-state-budget-mb``, follows the client between ranks, checkpointed).
Readings chosen:

* a client with no previous model yet (its first round) trains on CE alone. MOON's
  code has no negative in round 0 (l_con = 0 there too) and, with partial
  participation, uses a never-sampled client's *initial* network instead; the
  difference is one round per client;
* the global and previous networks run in evaluation mode (no dropout, BatchNorm's
  running statistics, nothing of theirs updated) and without gradients;
* aggregation weights are the sampled clients' data sizes (MOON's code indexes them
  wrongly under partial participation; the engine does not).

Batched clients (``--clients-at-once``, :mod:`fedhpc.batched`): z from the grouped forward
(``group.forward(x, return_features=True)``), z_glob and z_prev from grouped forwards of the
frozen networks in evaluation mode over the group's stacked anchors and previous models
(rows are independent there, so each client's rows equal its sequential batch's), l_con a
weighted sum of per-row losses (each client's mean over its real rows).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...batched import grouped_forward, stacked_buffers, stacked_params, weighted_task_loss
from ...errors import ConfigError
from ...flat import FlatModel
from ...models import model_option_params
from .. import register_algorithm
from ..base import task_loss
from .local_reg import LocalRegAlgorithm, LocalRegOptions


def contrastive_loss(z, z_glob, z_prev, temperature: float) -> torch.Tensor:
    """MOON's l_con, batch mean: cross-entropy of [sim(z, z_glob), sim(z, z_prev)] / tau against 0."""
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], 1)
    return F.cross_entropy(logits / temperature, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))


@dataclass
class MoonOptions(LocalRegOptions):
    mu: float = field(default=1.0, metadata={"help": "weight mu of the model-contrastive term (FedAlign study: 1)",
                                                "method_specific": True})
    temperature: float = field(default=0.5, metadata={"help": "temperature tau (MOON default 0.5)"})

    def validate(self):
        super().validate()
        if not self.mu >= 0:
            raise ConfigError(f"--mu must be >= 0, got {self.mu}")
        if not self.temperature > 0:
            raise ConfigError(f"--temperature must be > 0, got {self.temperature}")


@register_algorithm("moon")
class Moon(LocalRegAlgorithm):
    """FedAvg plus MOON's model-contrastive term; each client's previous model in the store."""

    Options = MoonOptions
    auto_model_kind = "residual"
    #: the FedAlign study's "two-layer projection layer" (MOON's l2 to 256) under --model auto
    auto_model_options = {"projection_dim": 256}
    uses_client_state = True
    #: batched_loss is ``loss`` for K clients (fedhpc.batched)
    batchable = True

    def setup(self):
        super().setup()
        if getattr(self.model, "proj_head", None) is None:
            # following the advice must give a run: a model without the option would refuse it next
            fix = ("add --model-opt projection_dim=256" if "projection_dim" in model_option_params(self.model_name)
                   else "pass --model resnet56 or resnet18 (resnet_digits for the digits data) with "
                        "--model-opt projection_dim=256")
            raise ConfigError(f"moon needs a model with a projection head; the run's model {self.model_named} "
                              f"has none: {fix}")
        # Frozen copies for the global and the previous model, each behind its own flat
        # buffer so that loading one is a single copy.
        self.frozen = {}
        for name in ("global", "previous"):
            net = copy.deepcopy(self.model).eval()
            for p in net.parameters():
                p.requires_grad_(False)
            self.frozen[name] = (net, FlatModel(net))
        self._frozen_global_kept = False  # whether frozen "global" holds a device's kept model
        self._group_frozen = None  # the batched path's frozen forwards of the group it trains

    def round_begin(self, rnd):
        self.frozen["global"][1].load_(self.global_state)
        self._frozen_global_kept = False  # the frozen "global" network holds the round's global model
        self._group_frozen = None

    def download(self, ctx):
        super().download(ctx)
        # The positive pair is the model the device starts from: a device whose broadcast was
        # lost (channel model) never received the global model and contrasts with the one it
        # kept. Reloaded only around such a device, so runs without a channel copy nothing.
        anchor = self.anchor_state(ctx)
        kept = anchor is not self.global_state
        if kept or self._frozen_global_kept:
            self.frozen["global"][1].load_(anchor)
            self._frozen_global_kept = kept
        previous = ctx.load_state()
        ctx.extra["has_previous"] = previous is not None
        if previous is not None:
            previous = previous.to(self.device)
            self.frozen["previous"][1].load_(previous)
            # The batched path downloads a whole group before training it, so the frozen networks
            # end up holding the group's last client's models: each client keeps its own here.
            ctx.extra["previous"] = previous

    def projection(self, name: str, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.frozen[name][0](x, return_features=True)[1]["projection"]

    def loss(self, model, x, y, ctx):
        logits, feats = model(x, return_features=True)
        loss = task_loss(logits, y)
        if ctx.extra["has_previous"] and self.options.mu > 0:
            z = feats["projection"]
            l_con = contrastive_loss(z, self.projection("global", x), self.projection("previous", x),
                                     self.options.temperature)
            loss = loss + self.options.mu * l_con
        return loss

    def batched_loss(self, group, x, y, weight):
        """``loss`` for K clients (fedhpc.batched): CE + mu l_con per client, l_con over its real rows
        (``weight``: 1/n_real on them, 0 on padding); a client without a previous model adds nothing."""
        logits, feats = group.forward(x, return_features=True)
        loss = weighted_task_loss(logits, y, weight)
        has_previous = [bool(ctx.extra["has_previous"]) for ctx in group.ctxs]
        if not any(has_previous) or self.options.mu <= 0:
            return loss
        z = feats["projection"]
        z_glob, z_prev = self.group_projections(group, x)
        k, b = z.shape[0], z.shape[1]
        sims = torch.stack([F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], -1)
        per_row = F.cross_entropy(sims.reshape(k * b, 2) / self.options.temperature,
                                  torch.zeros(k * b, dtype=torch.long, device=z.device), reduction="none")
        l_con = (per_row.view(k, b) * weight).sum(1)
        # where, not a product: a client without a previous model trains on CE alone, as in ``loss``
        has = torch.tensor(has_previous, device=l_con.device)
        return torch.where(has, loss + self.options.mu * l_con, loss)

    def group_projections(self, group, x):
        """(z_glob, z_prev), each (K, B, d): the frozen networks' projections of every client's rows,
        row k through client k's anchor (``anchor_state``) and its previous model (its anchor stands in
        for a client without one, whose term is dropped), in evaluation mode, without gradients.
        The stacked states are built once per group (the steps of one group share ``group.ctxs``)."""
        cached = self._group_frozen
        if cached is None or cached[0] is not group.ctxs:
            anchors = [self.anchor_state(ctx) for ctx in group.ctxs]
            previous = [ctx.extra.get("previous", a) for ctx, a in zip(group.ctxs, anchors)]
            forwards = []
            for name, states in (("global", anchors), ("previous", previous)):
                net, flat = self.frozen[name]
                stacked = torch.stack([s.to(flat.flat.dtype) for s in states])
                params = stacked_params(flat, stacked, trainable=set())  # read, never differentiated
                forwards.append(grouped_forward(net, params, stacked_buffers(flat, stacked[:, flat.num_params:])))
            if forwards[0] is None:
                raise ConfigError(f"moon with --clients-at-once > 1 needs a model whose layers with weights are all "
                                  f"Linear, Conv2d or BatchNorm (the run's model {self.model_named} is not); "
                                  f"run with --clients-at-once 1")
            cached = self._group_frozen = (group.ctxs, forwards[0], forwards[1])
        with torch.no_grad():
            z_glob = cached[1](x, return_features=True)[1]["projection"]
            z_prev = cached[2](x, return_features=True)[1]["projection"]
        return z_glob, z_prev

    def upload(self, model, ctx):
        ctx.save_state(self.flat.flat)  # this client's model: its "previous" next time it trains
        return super().upload(model, ctx)
