"""Ditto (Li, Hu, Beirami & Smith, ICML 2021): a personal model regularised towards the global one.

Each client keeps a personal model v_k (client-state store) besides training the global one.
As in the official code, on every mini-batch the client first takes ``--personal-steps``
steps on its personal objective

    h_k(v) = F_k(v) + (lam / 2) ||v - w^t||^2,  gradient  grad F_k(v) + lam (v - w^t)

(w^t: the global model the round started from), then one ordinary step on the global
model w (FedAvg's local update); it uploads w and keeps v_k. Each of the two models has its
own fresh optimiser of the run's kind (--optimizer) per client and round. A client's v_k
starts as the global model it first receives. ``--lam`` (official default 1).

The personalised model (evaluation) is v_k. A cold-start client trains v from the final
global model on h_k for ``--finetune-epochs`` epochs.

The engine's non-finite guard (NonFiniteLossError) reads the round's training loss
(``ctx.loss_sum``), which reports the global model's loss alone. The personal steps' losses and
the trained v_k enter it times 0: the reported loss is unchanged while both are finite, and a
diverging v_k (e.g. lam * lr > 2 on the proximal term) makes it NaN, so the round fails instead
of storing and evaluating a NaN personal model.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from ...batched import ClientGroup, proximal_terms, weighted_task_loss
from ...errors import ConfigError
from ...flat import FlatModel
from .. import register_algorithm
from ..base import task_loss
from .base import PersonalAlgorithm, PersonalOptions, fresh_optimizer


@dataclass
class DittoOptions(PersonalOptions):
    lam: float = field(default=1.0, metadata={"help": "lambda of the personal objective's (lam/2)||v - w||^2 (official: 1)",
                                                 "method_specific": True})
    personal_steps: int = field(default=1, metadata={"help": "personal steps per mini-batch, before the global step"})

    def validate(self):
        super().validate()
        if not (math.isfinite(self.lam) and self.lam >= 0):
            raise ConfigError(f"--lam must be a finite number >= 0, got {self.lam}")
        if self.personal_steps < 1:
            raise ConfigError(f"--personal-steps must be >= 1, got {self.personal_steps}")


@register_algorithm("ditto")
class Ditto(PersonalAlgorithm):
    """Ditto: per-client personal model with a proximal pull to the global model; global by FedAvg."""

    Options = DittoOptions
    uses_client_state = True
    #: --clients-at-once > 1 trains K clients' global and personal models at once, the same steps
    #: in the same order on the same batches (batched_local_update; fedhpc.batched)
    batchable = True

    def setup(self):
        super().setup()
        self.personal_net = copy.deepcopy(self.model)
        self.personal_flat = FlatModel(self.personal_net)

    def download(self, ctx):
        super().download(ctx)
        mine = ctx.load_state()
        # v_k starts as the global model the device first receives: the model it kept if the
        # broadcast was lost (channel model), which also anchors the pull below (anchor_state)
        self.personal_flat.load_(self.anchor_state(ctx) if mine is None else mine)

    def personal_step(self, x, y, opt, anchor) -> torch.Tensor:
        """One step on h_k: grad F_k(v) + lam (v - w^t), where ``anchor`` are w^t's parameters;
        returns the (detached) task loss F_k(v) before the step."""
        net = self.personal_net
        opt.zero_grad(set_to_none=True)
        loss = task_loss(net(x), y)
        loss.backward()
        with torch.no_grad():
            for p, w in zip(net.parameters(), anchor):
                if p.grad is not None:
                    p.grad.add_(p - w, alpha=self.options.lam)
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(list(net.parameters()), self.cfg.grad_clip)
        opt.step()
        return loss.detach()

    def local_update(self, model, ctx):
        self.personal_net.train(model.training)
        anchor = self.flat.param_views(self.anchor_state(ctx))  # w^t as this device received it
        popt = fresh_optimizer(self.cfg, self.personal_net.parameters(), ctx.lr)
        personal_sum = torch.zeros((), dtype=torch.float64, device=self.device)

        def personal_steps_then_global_loss(model, x, y, ctx):
            # each mini-batch: the personal model's steps on h_k first, then the global model's
            # step on the same batch (Ditto Alg. 1); only the global loss is recorded, the
            # personal losses add up on the device (no sync per step) for the guard below
            for _ in range(self.options.personal_steps):
                personal_sum.add_(self.personal_step(x, y, popt, anchor))
            return self.loss(model, x, y, ctx)

        self.train_epochs(model, ctx, self.cfg.local_epochs, loss_fn=personal_steps_then_global_loss)
        # The engine's non-finite guard reads ctx.loss_sum (one sync per client, in the engine).
        # Fold the personal side into it times 0: + 0 while finite (the reported loss is the global
        # model's, unchanged), NaN (NaN * 0 and inf * 0 are both NaN) once v_k diverged. The
        # trained v_k itself joins (max |v|: finite iff every entry is, NaN propagates), as its
        # last step can overflow after the last finite loss.
        personal_sum.add_(self.personal_flat.flat.detach().abs().amax().double())
        ctx.loss_sum.add_(personal_sum.mul_(0.0))

    def batched_downloaded(self, ctx):
        ctx.extra["personal_start"] = self.personal_flat.flat.detach().clone()  # the next download reloads it

    def batched_local_update(self, group):
        """``local_update`` for K clients at once (fedhpc.batched.GroupTraining): their personal models
        are a second stacked model, stepped inside the global model's loss as the sequential loss_fn
        steps them, before the global forward on the same batch (so from the same dropout streams)."""
        self.personal_net.train(self.model.training)
        starts = torch.stack([ctx.extra.pop("personal_start") for ctx in group.ctxs])
        personal = group.stacked(self.personal_net, self.personal_flat, starts)
        personal_sums = torch.zeros(len(group.ctxs), dtype=torch.float64, device=starts.device)

        def personal_steps_then_global_loss(g, x, y, weight):
            active = None if all(g.active) else torch.tensor(g.active, device=starts.device)
            for _ in range(self.options.personal_steps):
                on_v = ClientGroup(personal.forward(x), personal.params, g.ctxs, g.active, g.real, self.personal_flat)
                task = weighted_task_loss(on_v.forward(x, real=g.real), y, weight)
                # h_k = F_k(v) + (lam/2)||v - w^t||^2, w^t = anchor_state(ctx) as in personal_step
                personal.step(task + proximal_terms(on_v, self, self.options.lam), active)
                personal_sums.add_(task.detach().double())  # 0 for a client masked out of the step
            return self.batched_loss(g, x, y, weight)

        trained = group.train(group.starts, loss=personal_steps_then_global_loss)
        v = personal.states()
        # the non-finite guard of local_update, client by client (see the module docstring)
        guard = personal_sums + v.abs().amax(1).double()
        for i, ctx in enumerate(group.ctxs):
            ctx.loss_sum.add_(guard[i].mul(0.0))
            ctx.extra["personal_trained"] = v[i]
        return trained

    def batched_hand_back(self, ctx):
        self.personal_flat.load_(ctx.extra.pop("personal_trained"))  # what upload saves

    def upload(self, model, ctx):
        ctx.save_state(self.personal_flat.flat)
        return super().upload(model, ctx)

    def client_model(self, cid):
        return self.client_state.get_slot(cid, "algo")

    def adapt(self, model, ctx):
        g = self.flat.flat.detach().clone()  # the model holds the final global
        self.personal_flat.load_(g)
        self.personal_net.train()
        anchor = self.flat.param_views(g)
        popt = fresh_optimizer(self.cfg, self.personal_net.parameters(), ctx.lr)
        for epoch in range(self.options.finetune_epochs):
            for x, y in ctx.batches(epoch):
                self.personal_step(x, y, popt, anchor)
        self.flat.load_(self.personal_flat.flat)  # the engine evaluates ``model``
