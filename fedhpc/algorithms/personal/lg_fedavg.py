"""LG-FedAvg (Liang et al., 2020, "Think locally, act globally").

Local representation layers (personal, kept by each client) under global top layers
(averaged by the server). Clients train all layers jointly; only the global ones are sent.

Which layers are global [``--global-layers``]: the paper's reading is the top of the network,
default ``head`` (the classifier; e.g. ``last:2`` for two fully connected layers). Public code
disagrees: one repository makes the *first* layers global (``--global-layers first:2``), and
the official code's key order happens to make the convolutions global. A cold-start client
trains every layer jointly for ``--finetune-epochs`` (pMixFed App. 10.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import register_algorithm
from .base import PartialAlgorithm, PersonalOptions, split_layers


@dataclass
class LGFedAvgOptions(PersonalOptions):
    global_layers: str = field(default="head", metadata={
        "help": "layers averaged by the server (the rest are each client's local representation): "
                "names, head, base, first:K, last:K (paper: the top layers)"})


@register_algorithm("lg_fedavg")
class LGFedAvg(PartialAlgorithm):
    """LG-FedAvg: local representation layers, global top layers averaged."""

    Options = LGFedAvgOptions
    #: plain SGD steps on the task loss (all layers trained jointly): --clients-at-once > 1
    #: may train clients together (fedhpc.batched; PersonalAlgorithm.batched_loss)
    batchable = True

    def personal_layers(self):
        shared = split_layers(self.layer_map.names, self.options.global_layers, "--global-layers")
        return [i for i in range(self.layer_map.num_layers) if i not in shared]

    def local_update(self, model, ctx):
        self.joint_update(model, ctx, self.cfg.local_epochs)
