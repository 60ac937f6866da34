"""FedProx (Li et al., 2020): FedAvg whose local objective adds (mu/2) ||w - w_global||^2.

The proximal term keeps local models near the round's global model under
heterogeneous data (under a channel model, a device that missed the broadcast is kept
near the model it kept and starts from instead: ``Algorithm.anchor_state``).
:func:`add_proximal_term` is shared with the "+FedProx" variants of the mixup algorithms
(FedMix paper, Table 1), which take a ``prox_mu`` option.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..batched import proximal_terms, weighted_task_loss
from ..errors import ConfigError
from . import register_algorithm
from .base import Algorithm


def proximal_term(model, global_params, mu: float) -> torch.Tensor:
    """(mu/2) * sum over parameters of ||w - w_global||^2 (differentiable in w)."""
    sq = [(p - g).pow(2).sum() for p, g in zip(model.parameters(), global_params)]
    return 0.5 * mu * torch.stack(sq).sum()


def add_proximal_term(loss: torch.Tensor, algo, model, mu: float, ctx) -> torch.Tensor:
    """``loss`` plus (mu/2)||w - w_anchor||^2; ``loss`` when mu is 0.

    The anchor is the model the client started the round from (``algo.anchor_state(ctx)``):
    the round's global model, or, under a channel model, the model a device kept when the
    broadcast did not reach it (it cannot be pulled towards a model it never received).
    """
    if mu == 0:
        return loss
    return loss + proximal_term(model, algo.flat.param_views(algo.anchor_state(ctx)), mu)


@dataclass
class FedProxOptions:
    #: proximal coefficient mu (FedMix Table 8: 0.1 FEMNIST/CIFAR-10, 0.01 CIFAR-100). method_specific:
    #: FedAlign's, GradAug's, MOON's and pMixFed-Dynamic's mu weigh other terms (fedhpc.config)
    mu: float = field(default=0.01, metadata={"help": "proximal coefficient mu", "method_specific": True})

    def validate(self):
        if not self.mu >= 0:
            raise ConfigError(f"--mu must be non-negative, got {self.mu}")


@register_algorithm("fedprox")
class FedProx(Algorithm):
    """FedAvg with a proximal term (mu/2)||w - w_global||^2 in the local loss."""

    Options = FedProxOptions
    batchable = True

    def setup(self):
        self.options = self.options or FedProxOptions()

    def loss(self, model, x, y, ctx):
        return add_proximal_term(super().loss(model, x, y, ctx), self, model, self.options.mu, ctx)

    def batched_loss(self, group, x, y, weight):
        """``loss`` for K clients at once (fedhpc.batched): CE + (mu/2)||w_k - a_k||^2 per client,
        a_k client k's anchor (``anchor_state``)."""
        return weighted_task_loss(group.forward(x), y, weight) + proximal_terms(group, self, self.options.mu)
