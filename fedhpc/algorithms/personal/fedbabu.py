"""FedBABU (Oh, Kim & Yun, ICLR 2022): federated training of the body only, head fine-tuned at the end.

During federated training the head (default the last layer, ``--head-layers head``) keeps
its random initial values on every client and on the server: it is *truly* frozen, i.e. its
parameters are not even given to the optimiser, so neither momentum nor weight decay can move
it (a zero gradient would not be enough), and BatchNorm statistics in it would stay put too.
Clients train and send the body; the server averages the body.

Personalised evaluation fine-tunes the final global model (body and head) on each client's
training data for ``--finetune-epochs`` (pMixFed App. 10.1: 4) with a fresh optimiser, then
evaluates it on the client's test split. By default this happens at the final evaluation
only ("fine-tuning at the end"; also when --stop-epsilon ends the run early); earlier
evaluations report the global model
(``--finetune-every-eval`` fine-tunes at every one). Cold-start clients get the same
fine-tuning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import register_algorithm
from ..base import Upload
from .base import Part, PersonalAlgorithm, PersonalOptions, frozen, split_layers


@dataclass
class FedBABUOptions(PersonalOptions):
    head_layers: str = field(default="head", metadata={
        "help": "layers frozen at their initial values during federated training (FedBABU: the head)"})
    finetune_every_eval: bool = field(default=False, metadata={
        "help": "fine-tune every client at every evaluation, not only at the final one"})


@register_algorithm("fedbabu")
class FedBABU(PersonalAlgorithm):
    """FedBABU: the head frozen during federated training, body averaged; fine-tuned at the end."""

    Options = FedBABUOptions
    #: --clients-at-once > 1 trains the body of K clients at once, the head frozen as here
    #: (fedhpc.batched: no gradient, no step, its BatchNorm in eval mode)
    batchable = True

    def setup(self):
        super().setup()
        head = split_layers(self.layer_map.names, self.options.head_layers, "--head-layers")
        self.head = Part(self.layer_map, head)
        self.body = Part(self.layer_map, [i for i in range(self.layer_map.num_layers) if i not in head])
        self.head_modules = self.modules_of(head)

    def upload_spec(self):
        return {"body": Upload(self.body.numel, "parameters")}

    def download(self, ctx):
        self.restore_kept_model(ctx)  # a device whose last downlink failed keeps its model
        ctx.ledger.add("down", "parameters", self.body.numel * self.flat.flat.element_size())

    def local_update(self, model, ctx):
        with frozen(self.head_modules):
            self.train_epochs(model, ctx, self.cfg.local_epochs)  # a fresh optimiser over the body only

    def batched_local_update(self, group):
        with frozen(self.head_modules):  # the stacked optimiser, too, gets only what requires grad
            return group.train(group.starts)

    def upload(self, model, ctx):
        return {"body": self.body.gather(self.flat.flat)}

    def aggregate(self, global_state, totals, weight_total, rnd):
        if weight_total <= 0:
            return global_state
        new = global_state.to(torch.float64).clone()
        return self.body.scatter_(new, totals["body"] / weight_total)

    def fine_tune(self, model, ctx):
        self.train_epochs(model, ctx, self.options.finetune_epochs)

    def client_model(self, cid):
        if not (self.options.finetune_every_eval or self.final_evaluation):
            return self.kept_model(cid)  # the global model, or the one a device kept (channel model)
        return self.personalise_for_evaluation(cid, self.fine_tune)

    def adapt(self, model, ctx):
        self.fine_tune(model, ctx)
