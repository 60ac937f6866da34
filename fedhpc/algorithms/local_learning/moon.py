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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

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

    def round_begin(self, rnd):
        self.frozen["global"][1].load_(self.global_state)
        self._frozen_global_kept = False  # the frozen "global" network holds the round's global model

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
            self.frozen["previous"][1].load_(previous.to(self.device))

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

    def upload(self, model, ctx):
        ctx.save_state(self.flat.flat)  # this client's model: its "previous" next time it trains
        return super().upload(model, ctx)
