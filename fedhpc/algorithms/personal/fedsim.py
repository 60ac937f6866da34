"""FedSim (Pillutla et al., ICML 2022, "Federated learning with partial model personalization").

The model is split into shared layers u (averaged by the server) and personal layers v_k
(kept by each client, never sent). FedSim updates both *simultaneously*: every local step is
one step of the optimiser on (u, v_k) together; the client then uploads u and keeps v_k.

Split [``--shared-layers``]: pMixFed's Sec. 5.1 fixes it "in the middle of the network: for
CNNs, layers [1,2] are shared, while for MobileNet, layers [1-7]": the first half of the
declared layers, ``first:half`` (5 layers of ``pmixfed_cnn`` -> 2, 15 of ``mobilenet`` -> 7).
Any selection by name works (see :func:`fedhpc.algorithms.personal.select_layers`).

A cold-start client (App. 10.1: "both the global and local models are fine-tuned partially but
simultaneously") trains u and its (initial) v together for ``--finetune-epochs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import register_algorithm
from .base import PartialAlgorithm, PersonalOptions, split_layers


@dataclass
class FedSimOptions(PersonalOptions):
    shared_layers: str = field(default="first:half", metadata={
        "help": "layers averaged by the server (the rest stay personal): names, head, base, first:K, "
                "last:K, first:half (pMixFed Sec. 5.1: the first half)"})


@register_algorithm("fedsim")
class FedSim(PartialAlgorithm):
    """FedSim: shared and personal layers updated together; shared ones averaged."""

    Options = FedSimOptions
    #: plain SGD steps on the task loss (shared and personal layers in one step): --clients-at-once > 1
    #: may train clients together (fedhpc.batched; PersonalAlgorithm.batched_loss)
    batchable = True

    def personal_layers(self):
        shared = split_layers(self.layer_map.names, self.options.shared_layers, "--shared-layers")
        return [i for i in range(self.layer_map.num_layers) if i not in shared]

    def local_update(self, model, ctx):
        self.joint_update(model, ctx, self.cfg.local_epochs)
