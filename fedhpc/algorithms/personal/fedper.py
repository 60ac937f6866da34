"""FedPer (Arivazhagan et al., 2019): shared base layers, personal top layers.

Clients train the whole model; the server averages only the base layers; each client keeps
its personal layers (default the head, ``--personal-layers head``) in the client-state store
(bounded memory, spilled to disk, follows the client between ranks, checkpointed). It is
FedSim's simultaneous update with the personal part on top. A client that has not trained yet
uses the initial head; a cold-start client trains body and head together for
``--finetune-epochs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import register_algorithm
from .base import PartialAlgorithm, PersonalOptions, split_layers


@dataclass
class FedPerOptions(PersonalOptions):
    personal_layers: str = field(default="head", metadata={
        "help": "layers each client keeps for itself: names, head, base, first:K, last:K (FedPer: the head)"})


@register_algorithm("fedper")
class FedPer(PartialAlgorithm):
    """FedPer: personal head kept by each client, base layers averaged."""

    Options = FedPerOptions
    #: plain SGD steps on the task loss (body and head trained jointly): --clients-at-once > 1
    #: may train clients together (fedhpc.batched; PersonalAlgorithm.batched_loss)
    batchable = True

    def personal_layers(self):
        return split_layers(self.layer_map.names, self.options.personal_layers, "--personal-layers")

    def local_update(self, model, ctx):
        self.joint_update(model, ctx, self.cfg.local_epochs)
