"""FedAvg (McMahan et al., 2017): local SGD, then the sample-weighted average of the models.

All behaviour is the base class's: w <- sum_k n_k w_k / sum_k n_k over the clients
that reported this round. Optional server learning rate / momentum (FedAvgM) are
exposed because several of the papers' baselines use them. They step the parameters
only: BatchNorm's running statistics are not a model being optimised, and a step
past the clients' average can take a running variance below zero (a NaN test loss),
so buffers always take the plain average.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..batched import weighted_task_loss
from ..errors import ConfigError
from . import ALGORITHMS, register_algorithm
from .base import Algorithm


@dataclass
class FedAvgOptions:
    # method_specific: other methods' server_lr / server_momentum belong to a server trainer
    # (FLD, MixFL), so --algo fedavg over their files must not step by their learning rate
    server_lr: float = field(default=1.0, metadata={
        "help": "server step size on the averaged update (1.0 = plain FedAvg)", "method_specific": True})
    server_momentum: float = field(default=0.0, metadata={
        "help": "server momentum on the averaged update (FedAvgM; 0 = off)", "method_specific": True})
    finetune_epochs: int = field(default=0, metadata={
        "help": "epochs a client fine-tunes the final global model, all layers, before --final-adapt and "
                "--cold-start-fraction evaluate it (pMixFed App. 10.1: r = 4; 0 = the global model as it is)"})

    def validate(self):
        if self.finetune_epochs < 0:
            raise ConfigError(f"--finetune-epochs must be >= 0, got {self.finetune_epochs}")
        if not self.server_lr > 0:
            raise ConfigError(f"--server-lr must be positive, got {self.server_lr}")
        if not 0 <= self.server_momentum < 1:
            raise ConfigError(f"--server-momentum must be in [0, 1), got {self.server_momentum}")


@register_algorithm("fedavg")
class FedAvg(Algorithm):
    """Federated averaging: weighted mean of the clients' models (also --algo fl)."""

    Options = FedAvgOptions
    #: plain SGD steps on the task loss: --clients-at-once > 1 may train clients together
    batchable = True

    def batched_loss(self, group, x, y, weight):
        """``loss`` for K clients at once (fedhpc.batched): each client's batch-mean CE."""
        return weighted_task_loss(group.forward(x), y, weight)

    def setup(self):
        self.options = self.options or FedAvgOptions()
        self.server_velocity = None

    def aggregate(self, global_state, totals, weight_total, rnd):
        o = self.options
        if weight_total <= 0:  # nothing arrived: no server step either (momentum would still move it)
            return global_state
        average = super().aggregate(global_state, totals, weight_total, rnd)
        if o.server_lr == 1.0 and o.server_momentum == 0.0:
            return average
        # Treat (global - average) as a pseudo-gradient, as FedAvgM / FedOpt do.
        delta = global_state - average
        if o.server_momentum > 0:
            if self.server_velocity is None:
                self.server_velocity = torch.zeros_like(delta)
            self.server_velocity.mul_(o.server_momentum).add_(delta)
            delta = self.server_velocity
        stepped = global_state - o.server_lr * delta
        params = self.flat.num_params  # parameters come first; buffers (BN statistics): the plain average
        stepped[params:] = average[params:]
        return stepped

    def adapt(self, model, ctx):
        """A client personalising the final global model (pMixFed App. 10.1: FedAvg "simply
        involves updating all layers jointly during the fine-tuning process"): the local update
        for ``finetune_epochs`` epochs."""
        if self.options.finetune_epochs > 0:
            self.local_update(model, ctx, epochs=self.options.finetune_epochs)

    def state_dict(self):
        return {"server_velocity": self.server_velocity}

    def load_state_dict(self, state):
        self.server_velocity = state.get("server_velocity")


ALGORITHMS.alias("fl", "fedavg")  # the Mix2FLD paper's name for it
