"""Mixup (Zhang et al., ICLR 2018) as a local regulariser, as FedAlign's study runs it (Sec. 3.1).

Every mini-batch is mixed with a random permutation of itself:

    x~ = beta x_i + (1 - beta) x_j,   y~ = beta y_i + (1 - beta) y_j,   beta ~ Beta(gamma, gamma)

and trained with the cross-entropy against y~, i.e. beta CE(f(x~), y_i) + (1 - beta)
CE(f(x~), y_j). One beta per batch; the study's gamma is 0.1. The authors' code
defaults to gamma 0, meaning *no mixing* unless the flag is set; here ``gamma=0``
means the same (plain CE), and the default is the paper's 0.1. Draws are seeded by
(seed, round, client): the permutation from the ``"mixup_perm"`` torch stream, beta
from a numpy generator seeded with ``derive_seed(seed, "mixup_beta", round, cid)``,
one draw of each per batch in batch order. Text models mix in embedding space
(:class:`fedhpc.algorithms.mafl.mixing.MixSpace`). (LocalMix of the FedMix paper is the
same idea with a fixed ratio by default.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...batched import weighted_task_loss
from ...data.base import host_to_device
from ...errors import ConfigError
from .. import register_algorithm
from ..base import derive_seed, task_loss
from .local_reg import LocalRegAlgorithm, LocalRegOptions
from ..mafl.mixing import MixSpace, batched_mixup_loss, mixup_loss, permuted_rows


@dataclass
class MixupOptions(LocalRegOptions):
    gamma: float = field(default=0.1, metadata={
        "help": "beta ~ Beta(gamma, gamma) per batch (paper 0.1; 0 = no mixing, the authors' code default)"})

    def validate(self):
        super().validate()
        if not self.gamma >= 0:
            raise ConfigError(f"--gamma must be >= 0 (0 = no mixing), got {self.gamma}")


@register_algorithm("mixup")
class Mixup(LocalRegAlgorithm):
    """FedAvg with mixup of each batch with a permutation of itself."""

    Options = MixupOptions
    #: plain SGD steps on ``loss``; batched_loss is the same loss for K clients (fedhpc.batched)
    batchable = True

    def setup(self):
        super().setup()
        self.space = MixSpace(self.data.task, self.data.num_classes)
        self.space.check(self.model, self.model_named)

    def loss(self, model, x, y, ctx):
        gamma = self.options.gamma
        if gamma <= 0:
            return task_loss(model(x), y)
        if "beta_rng" not in ctx.extra:
            ctx.extra["beta_rng"] = np.random.default_rng(derive_seed(ctx.cfg.seed, "mixup_beta", ctx.round.index, ctx.cid))
            ctx.extra["perm_gen"] = ctx.generator("mixup_perm")
        beta = float(ctx.extra["beta_rng"].beta(gamma, gamma))
        perm = host_to_device(torch.randperm(x.shape[0], generator=ctx.extra["perm_gen"]), x.device)
        xin = self.space.lift(model, x)
        yin = self.space.labels(y, xin.dtype if xin.is_floating_point() else torch.float32)
        # mixup_loss mixes (1 - l) x1 + l x2: l = 1 - beta puts beta on the batch itself
        return mixup_loss(self.space.f(model), xin, yin, xin[perm], yin[perm], 1.0 - beta)

    def batched_loss(self, group, x, y, weight):
        """``loss`` for K clients (fedhpc.batched): each active client draws its beta, then its
        permutation of its real rows, from its own streams as ``loss`` does; padded rows map to
        themselves (weight 0). Mixing ratio per client: 1 - beta on the permuted batch."""
        gamma = self.options.gamma
        if gamma <= 0:
            return weighted_task_loss(group.forward(x), y, weight)
        k, b = x.shape[0], x.shape[1]
        perm = torch.arange(b).repeat(k, 1)  # made on the host, sent in one copy
        lam = torch.zeros(k, dtype=torch.float64)
        for i, ctx in enumerate(group.ctxs):
            if not group.active[i]:
                continue
            if "beta_rng" not in ctx.extra:  # the streams loss opens, in its order of draws
                ctx.extra["beta_rng"] = np.random.default_rng(derive_seed(ctx.cfg.seed, "mixup_beta", ctx.round.index,
                                                                          ctx.cid))
                ctx.extra["perm_gen"] = ctx.generator("mixup_perm")
            lam[i] = 1.0 - float(ctx.extra["beta_rng"].beta(gamma, gamma))
            n = group.real[i]
            perm[i, :n] = torch.randperm(n, generator=ctx.extra["perm_gen"])
        yin = self.space.labels(y, x.dtype)
        x2, y2 = permuted_rows(x, yin, perm)
        return batched_mixup_loss(group.forward, x, yin, x2, y2, host_to_device(lam, x.device), weight)
