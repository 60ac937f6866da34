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
size alpha on its own training batches; a cold-start client adapts the same way. Defaults
from the public implementations: alpha 0.01, d = 1e-3; the outer rate beta is --lr.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from . import register_algorithm
from .personal import PersonalAlgorithm, PersonalOptions


@dataclass
class PerFedAvgOptions(PersonalOptions):
    variant: str = field(default="fo", metadata={"help": "fo (first-order) | hf (Hessian-free)"})
    alpha: float = field(default=0.01, metadata={"help": "inner (adaptation) step size alpha"})
    delta: float = field(default=1e-3, metadata={"help": "finite-difference step d of HF's Hessian-vector product"})
    adapt_steps: int = field(default=1, metadata={"help": "SGD steps of size alpha before personalised evaluation"})

    def validate(self):
        super().validate()
        if self.variant not in ("fo", "hf"):
            raise ConfigError(f"--variant must be fo or hf, got {self.variant!r}")
        if not self.alpha > 0 or not self.delta > 0:
            raise ConfigError(f"--alpha and --delta must be positive, got {self.alpha} and {self.delta}")
        if self.adapt_steps < 0:
            raise ConfigError(f"--adapt-steps must be >= 0, got {self.adapt_steps}")


@register_algorithm("per_fedavg")
class PerFedAvg(PersonalAlgorithm):
    """Per-FedAvg: MAML-style local meta-steps (FO or HF), FedAvg; one adaptation step to personalise."""

    Options = PerFedAvgOptions

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
        """``adapt_steps`` plain SGD steps of size alpha on the client's first training batches."""
        batches = ctx.batches(0)
        for _, (x, y) in zip(range(self.options.adapt_steps), batches):
            _, g = self.grads(model, x, y, ctx)
            self.sgd_step(model, g, self.options.alpha)

    def client_model(self, cid):
        return self.personalise_for_evaluation(cid, self.one_step_adaptation)

    def adapt(self, model, ctx):
        self.one_step_adaptation(model, ctx)
