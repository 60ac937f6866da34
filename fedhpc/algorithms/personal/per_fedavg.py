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

Batched clients (``--clients-at-once K``, :mod:`fedhpc.batched`): the same meta-steps on K clients'
stacked weights, meta-step m of every client at once, each client on its own group of batches
(its own epoch, wrapped at its own length; a client with fewer groups sits out the later
meta-steps). Each pass reads its batch's real rows (dropout masks from the client's own stream, HF's
two passes rewound to the same masks; BatchNorm statistics over its real rows, updated by every pass).

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

from ...batched import ClientGroup, epoch_batches
from ...data.base import host_to_device
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
    #: its own opt-in: local_update's meta-steps have their batched twin in batched_local_update
    batchable = True

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

    def batched_local_update(self, group):
        """``local_update`` for K clients at once (fedhpc.batched.GroupTraining): meta-step m of each
        client on its own batches (m k + j) mod n_batches, j < k, in one stacked pass per batch."""
        o, cfg = self.options, self.cfg
        k = 3 if o.variant == "hf" else 2
        stacked = group.stacked(self.model, self.flat, group.starts)
        ctxs, n, p = group.ctxs, len(group.ctxs), self.flat.num_params
        device = group.starts.device
        clients = torch.arange(n, device=device)
        loss_sums = torch.zeros(n, dtype=torch.float64, device=device)
        weights = stacked.theta[:, :p]  # (K, num_params): the clients' w, stepped in place

        def pass_on(eb, batches, forward, active, taking, j, m):
            """The clients' losses (K,) on batch j of their meta-step m's group (``batches``: how many
            each client has this epoch), and its real rows; a client sitting out (``taking`` False, the
            device copy of ``active``) reads its batch 0 at weight 0 (its step is masked out too)."""
            index = [(m * k + j) % b if on else 0 for on, b in zip(active, batches)]
            rows = [eb.real[i][b] if active[i] else 0 for i, b in enumerate(index)]
            at = host_to_device(torch.tensor(index), device)  # host lists go over without a wait on the GPU
            x, y = eb.x[clients, at], eb.y[clients, at]
            weight = eb.weight[clients, at] * taking[:, None]

            def forward_rows(inputs, real=None):  # this batch's real rows unless a call names its own
                return forward(inputs, real=rows if real is None else real)
            view = ClientGroup(forward_rows, stacked.params, ctxs, active, rows, self.flat, stacked.buffers,
                               rng=stacked.step_rows.rng)
            return self.batched_loss(view, x, y, weight), rows

        for epoch in range(cfg.local_epochs):
            eb = epoch_batches(ctxs, epoch, cfg.batch_size)
            if eb is None:
                continue
            forward = stacked.forward(eb.x[:, 0])
            batches = [sum(1 for rows in real if rows > 0) for real in eb.real]
            for m in range(max(-(-b // k) for b in batches)):
                active = [m * k < b for b in batches]
                taking = host_to_device(torch.tensor(active), device)  # one copy a meta-step, read by every pass
                w = weights.detach().clone()
                stacked.gradient(pass_on(eb, batches, forward, active, taking, 0, m)[0])
                with torch.no_grad():
                    weights.sub_(stacked.grad[:, :p], alpha=o.alpha)              # w' = w - alpha grad f(w; D1)
                loss, real = pass_on(eb, batches, forward, active, taking, 1, m)
                columns = stacked.gradient(loss)                                # grad f(w'; D2)
                with torch.no_grad():
                    weights.copy_(w)                                            # restore w
                if o.variant == "hf":
                    g = stacked.grad[:, :p].clone()
                    rng = stacked.step_rows.rng
                    rewind = list(rng) if rng is not None else None
                    with torch.no_grad():
                        weights.sub_(g, alpha=-o.delta)                         # w + d g
                    stacked.gradient(pass_on(eb, batches, forward, active, taking, 2, m)[0])
                    gp = stacked.grad[:, :p].clone()
                    if rewind is not None:
                        rng[:] = rewind  # the same dropout masks for the second pass
                    with torch.no_grad():
                        weights.copy_(w).sub_(g, alpha=o.delta)                 # w - d g
                    stacked.gradient(pass_on(eb, batches, forward, active, taking, 2, m)[0])
                    with torch.no_grad():
                        weights.copy_(w)
                        gm = stacked.grad[:, :p]
                        stacked.grad[:, :p] = g - o.alpha * (gp - gm) / (2 * o.delta)
                stacked.apply(columns, None if all(active) else taking)
                counts = host_to_device(torch.tensor(real, dtype=torch.float64), device)
                loss_sums.add_(loss.detach().double() * counts)
                for ctx, rows in zip(ctxs, real):
                    ctx.samples += rows
        for i, ctx in enumerate(ctxs):
            ctx.loss_sum.add_(loss_sums[i])
        return stacked.states()

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
