"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, NeurIPS 2020): FedAvg of a MAML objective.

Each local step (a "meta-step") of a client, from parameters w, on consecutive mini-batches:

    w' = w - alpha grad f(w; D1)                                 (inner step, plain SGD)
    FO: g = grad f(w'; D2)
    HF: g = (I - alpha H(w; D3)) grad f(w'; D2),   H v ~ [grad f(w + d v; D3) - grad f(w - d v; D3)] / (2 d)
        (both passes with the same dropout masks)
    w  <- the local optimiser's step from w with gradient g    (beta = --lr)

The parameters are restored to w before the meta step (an early public version updated
from w' and was not reproducible); BatchNorm statistics keep what every forward pass did.
Each epoch's batches are taken in groups of 2 (FO) or 3 (HF) in order; a short last group is
completed with the epoch's first batches. FedAvg aggregates w.

Personalised evaluation (the paper's: one step of local adaptation before testing): each
client's model is the current global model after ``--adapt-steps`` (1) plain SGD steps of
size alpha on its own training batches, epoch 0's batches in order, then epoch 1's, ... until
that many steps are taken. Defaults from the public implementations: alpha 0.01, d = 1e-3;
the outer rate beta is --lr.

A cold-start client (--cold-start-fraction) and --final-adapt adapt the final global model:
with ``--finetune-epochs`` 0 (Per-FedAvg's default) the same way (``--adapt-steps`` steps of
size alpha); with r > 0 as pMixFed's comparison does (App. 10.1: the global model is
"personalized according to each baseline's ... fine-tuning algorithm for r = 4 local epochs";
for Per-FedAvg this "simply involves updating all layers jointly"): r epochs of the run's
optimiser (--optimizer, --lr decayed to the run's end) on all layers, as FedAvg and LG-FedAvg
fine-tune, and no alpha steps after them. The pMixFed launch files set r = 4 for every method.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...errors import ConfigError
from .. import register_algorithm
from .base import PersonalAlgorithm, PersonalOptions


@dataclass
class PerFedAvgOptions(PersonalOptions):
    variant: str = field(default="fo", metadata={"help": "fo (first-order) | hf (Hessian-free)"})
    alpha: float = field(default=0.01, metadata={"help": "inner (adaptation) step size alpha"})
    delta: float = field(default=1e-3, metadata={"help": "finite-difference step d of HF's Hessian-vector product"})
    adapt_steps: int = field(default=1, metadata={
        "help": "SGD steps of size alpha before personalised evaluation (over as many epochs of the client's "
                "batches as they take); also a cold-start client's adaptation while --finetune-epochs is 0"})
    # Per-FedAvg's own default is 0: a cold-start client adapts like a trained one (--adapt-steps);
    # the pMixFed comparison's r = 4 (App. 10.1) is asked for explicitly, as for FedAvg.
    finetune_epochs: int = field(default=0, metadata={
        "help": "epochs a cold-start client (--cold-start-fraction) and --final-adapt fine-tune the final global "
                "model, all layers jointly, with the run's optimiser (pMixFed App. 10.1: r = 4), instead of "
                "--adapt-steps steps of size alpha (0, the default: Per-FedAvg's own adaptation)"})

    def validate(self):
        super().validate()
        if self.variant not in ("fo", "hf"):
            raise ConfigError(f"--variant must be fo or hf, got {self.variant!r}")
        for name in ("alpha", "delta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"--{name} must be a finite number > 0, got {value}")
        if self.adapt_steps < 0:
            raise ConfigError(f"--adapt-steps must be >= 0, got {self.adapt_steps}")


@register_algorithm("per_fedavg")
class PerFedAvg(PersonalAlgorithm):
    """Per-FedAvg: MAML-style local meta-steps (FO or HF), FedAvg; one adaptation step to personalise."""

    Options = PerFedAvgOptions
    #: why --clients-at-once > 1 refuses it (fedhpc.batched.check_batchable names this)
    not_batchable_because = ("its meta-steps (an inner step of size alpha, the gradient at the adapted weights, "
                             "the weights restored; HF's finite differences on rewound dropout masks) run on "
                             "groups of 2 or 3 batches that wrap around each client's own epoch, not the "
                             "batched path's one step per batch")

    def grads(self, model, x, y, ctx):
        loss = self.loss(model, x, y, ctx)
        return loss, torch.autograd.grad(loss, list(model.parameters()))

    def sgd_step(self, model, grads, lr: float) -> None:
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p.sub_(g, alpha=lr)

    def meta_gradient(self, model, batches, ctx):
        """(outer loss, g) at the current w; the parameters are back at w on return."""
        o = self.options
        params = self.flat.flat[:self.flat.num_params]  # parameters come first
        w = params.detach().clone()
        _, g1 = self.grads(model, *batches[0], ctx)
        self.sgd_step(model, g1, o.alpha)                      # w' = w - alpha grad f(w; D1)
        loss, g = self.grads(model, *batches[1], ctx)          # grad f(w'; D2)
        params.copy_(w)                                        # restore w before the meta step
        if o.variant == "hf":
            # Both finite-difference passes draw the same dropout masks (the generator is
            # rewound for the second): with their own masks, gp - gm would be mask noise, which
            # alpha / (2 d) (5 at the defaults) amplifies, instead of 2 d H g.
            rng_devices = [self.device.index or 0] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=rng_devices):
                self.sgd_step(model, g, -o.delta)              # w + d g
                _, gp = self.grads(model, *batches[2], ctx)
            params.copy_(w)
            self.sgd_step(model, g, o.delta)                   # w - d g
            _, gm = self.grads(model, *batches[2], ctx)
            params.copy_(w)
            g = [a - o.alpha * (p - m) / (2 * o.delta) for a, p, m in zip(g, gp, gm)]
        return loss, g

    def local_update(self, model, ctx):
        opt = self.make_optimizer(model, ctx)
        params = list(model.parameters())
        k = 3 if self.options.variant == "hf" else 2
        for epoch in range(self.cfg.local_epochs):
            batches = list(ctx.batches(epoch))
            for s in range(0, len(batches), k):
                group = [batches[(s + j) % len(batches)] for j in range(k)]
                loss, g = self.meta_gradient(model, group, ctx)
                for p, gi in zip(params, g):
                    p.grad = gi
                if self.cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
                opt.step()
                ctx.record(loss, group[1][1].shape[0])

    def one_step_adaptation(self, model, ctx):
        """``adapt_steps`` plain SGD steps of size alpha on the client's training batches: epoch
        0's in order, then epoch 1's (``ctx.batches(1)``, its own shuffle), ... until taken."""
        wanted, taken, epoch = self.options.adapt_steps, 0, 0
        while taken < wanted:
            before = taken
            for x, y in ctx.batches(epoch):
                _, g = self.grads(model, x, y, ctx)
                self.sgd_step(model, g, self.options.alpha)
                taken += 1
                if taken == wanted:
                    break
            if taken == before:  # no training batches at all: nothing to adapt on
                break
            epoch += 1

    def client_model(self, cid):
        return self.personalise_for_evaluation(cid, self.one_step_adaptation)

    def adapt(self, model, ctx):
        """Cold start / --final-adapt: ``finetune_epochs`` epochs of joint fine-tuning of all
        layers (pMixFed App. 10.1) when > 0, else Per-FedAvg's ``adapt_steps`` alpha steps."""
        if self.options.finetune_epochs > 0:
            self.train_epochs(model, ctx, self.options.finetune_epochs)
        else:
            self.one_step_adaptation(model, ctx)
