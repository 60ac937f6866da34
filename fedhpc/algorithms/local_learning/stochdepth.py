"""Stochastic depth (Huang et al., ECCV 2016) as a local regulariser, as FedAlign's study runs it (Sec. 3.1).

Residual block l outputs zeta_l = sigma(lambda_l F_l(zeta_{l-1}) + I(zeta_{l-1})) with
lambda_l ~ Bernoulli(rho_l) in training and lambda_l = rho_l at evaluation (the
expectation, Huang et al. Eq. 5), and the keep probabilities decay linearly over the
L blocks: rho_l = 1 - (l / L)(1 - rho_L) (the paper's rule, Sec. 3.1). The study's
rho_L is 0.9. The authors' code ends at 0.5 on another schedule: block 1 at 1.0, then
steps of (1 - rho_L) / (L - 1), so ``--final-keep-prob 0.5`` does not reproduce it. On
ResNet-56's 18 blocks that flag puts block 1 at 1 - 0.5/18 = 0.972 (theirs 1.0) and
keeps 13.25 blocks in expectation (theirs 13.50). One draw per block per batch, for
the whole batch, from a generator seeded by (seed, round, client) (the
``"stochdepth"`` stream: one ``torch.rand(())`` per block in block order, batch
after batch). Everything else is FedAvg; the global model is evaluated with the
residuals scaled, in the engine as in ``python -m fedhpc.analysis.hessian``.

Batched clients (``--clients-at-once K``, :mod:`fedhpc.batched`): before each step every client
draws its blocks' Bernoullis from its own stream, in the order its sequential forward draws them;
each block keeps or drops its residual branch client by client (``client_keep``). What a dropped
block leaves alone in the sequential step stays alone for that client: its branch's parameters take
no step (``ClientGroup.skip``: torch's SGD skips None gradients, no momentum, no weight decay) and its
BatchNorm running statistics keep their values (restored after the forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ...batched import weighted_task_loss
from ...data.base import host_to_device
from ...errors import ConfigError
from .. import register_algorithm
from .local_reg import LocalRegAlgorithm, LocalRegOptions, require_resnet


@dataclass
class StochDepthOptions(LocalRegOptions):
    final_keep_prob: float = field(default=0.9, metadata={
        "help": "keep probability rho_L of the last residual block (paper 0.9; authors' code 0.5, "
                "on a schedule that keeps block 1 at 1.0)"})

    def validate(self):
        super().validate()
        if not 0 < self.final_keep_prob <= 1:
            raise ConfigError(f"--final-keep-prob must be in (0, 1], got {self.final_keep_prob}")


@register_algorithm("stochdepth")
class StochDepth(LocalRegAlgorithm):
    """FedAvg training a ResNet whose residual blocks are dropped at random."""

    Options = StochDepthOptions
    auto_model_kind = "residual"
    #: CE steps on the model whose blocks drop (local_update); batched_loss: K clients, each its own drops
    batchable = True

    def setup(self):
        super().setup()
        require_resnet(self, "set_stochastic_depth", "set_depth_generator")
        self._branch_parts: Optional[List[Tuple[torch.Tensor, List[str]]]] = None  # made on first use

    # The keep probabilities go onto the shared model when training starts (every round,
    # and on resume, which may evaluate without a round), not at construction: until then
    # the engine's model is the plain network (the standard test's FedAvg reference copies it).
    def round_begin(self, rnd):
        self.configure_model(self.model, self.options)

    def load_state_dict(self, state):
        self.configure_model(self.model, self.options)

    @classmethod
    def configure_model(cls, model, options):
        model.set_stochastic_depth(options.final_keep_prob)

    def local_update(self, model, ctx):
        model.set_depth_generator(ctx.generator("stochdepth"))
        try:
            super().local_update(model, ctx)
        finally:
            model.set_depth_generator(None)

    # ---------------------------------------------------------------- K clients at once
    def _branches(self) -> List[Tuple[torch.Tensor, List[str]]]:
        """Per residual block, what a client that drops it leaves alone: its branch's parameter
        columns ((num_params,) bool) and the names of its branch's float buffers."""
        if self._branch_parts is None:
            names = {id(m): n for n, m in self.model.named_modules()}
            parts = []
            for block in self.model.blocks:
                modules = [f"{names[id(block)]}.{child}" for child in block.residual_branch()]
                buffers = [f"{m}.{n}" for m in modules for n, b in self.model.get_submodule(m).named_buffers()
                           if b.is_floating_point()]
                parts.append((self.flat.mask(modules)[:self.flat.num_params], buffers))
            self._branch_parts = parts
        return self._branch_parts

    def batched_local_update(self, group):
        # Every block keeps its branch for all clients outside the steps' forwards (the batched path's
        # one-off check of its folded forward against vmap runs the model in training mode): no draw
        # from torch's generator, which the sequential path never makes.
        for block in self.model.blocks:
            block.client_keep = True
        try:
            return super().batched_local_update(group)
        finally:
            for block in self.model.blocks:
                block.client_keep = None

    def batched_loss(self, group, x, y, weight):
        """``loss`` (cross-entropy) for K clients, each dropping the blocks its own draws drop."""
        blocks = self.model.blocks
        keep = torch.ones(len(blocks), len(group.ctxs))
        for i, ctx in enumerate(group.ctxs):
            if not group.active[i]:
                continue  # takes no step: draws nothing, as it runs no forward
            gen = ctx.extra.setdefault("depth_gen", ctx.generator("stochdepth"))
            for l, block in enumerate(blocks):
                if block.keep_prob < 1.0:  # the sequential forward's draw, block after block
                    keep[l, i] = float(block.draws_keep(gen))
        dropped = {}  # block -> the clients that drop it this step
        for l in range(len(blocks)):
            clients = (keep[l] == 0).nonzero().flatten().tolist()
            if clients:
                dropped[l] = clients
        branches = self._branches()
        saved = {name: group.buffers[name].clone() for l in dropped for name in branches[l][1]}
        on_device = host_to_device(keep, x.device) if dropped else None  # one copy a step
        try:
            for l, block in enumerate(blocks):
                block.client_keep = on_device[l] if l in dropped else True
            logits = group.forward(x)
        finally:
            for block in blocks:
                block.client_keep = True
        for l, clients in dropped.items():
            columns, buffers = branches[l]
            mask = on_device[l] == 0
            for name in buffers:  # the forward updated every client's statistics: a dropped block's stay
                rows = group.buffers[name]
                rows.copy_(torch.where(mask.view((-1,) + (1,) * (rows.dim() - 1)), saved[name], rows))
            group.skip(clients, columns)
        return weighted_task_loss(logits, y, weight)
