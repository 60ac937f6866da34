"""FedMix (FedMix paper, Alg. 2 / Eq. 5): global mixup approximated with other clients' means.

Everything but the loss is NaiveMix's (:mod:`fedhpc.algorithms.mafl.naivemix`): the
MAFL mean-data exchange, one received entry (xbar, ybar) per mini-batch (or per
sample), the optional FedProx term, the ledger. The loss on a batch, x' = (1-l) x:

    l1 = (1-l) L(f(x'), y)
    l2 = l     L(f(x'), ybar)
    l3 = l     <dL/dx evaluated at (x', y), xbar>

l3 differentiates the *loss* (not the logits) with respect to the input, with
``create_graph=True``, so its weight-gradient is a second-order term computed by
double backward (:func:`fedhpc.algorithms.mafl.mixing.fedmix_loss`). Up to O(l^2)
this equals the global-mixup loss of Eq. 3 over the raw samples behind xbar
(tests/test_fedmix.py checks both facts).

Defaults follow the paper's CIFAR-10 row of Table 8 (l = 0.05); FEMNIST uses 0.2
and CIFAR-100 0.1 (launch/fedmix_*.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...models.shapes import has_batchnorm
from .. import register_algorithm
from .mixing import batched_fedmix_loss, fedmix_loss
from .naivemix import NaiveMix, NaiveMixOptions


@dataclass
class FedMixOptions(NaiveMixOptions):
    lam: float = field(default=0.05, metadata={
        "help": "mixing ratio lambda (Table 8: FEMNIST 0.2, CIFAR-10 0.05, CIFAR-100 0.1)"})


@register_algorithm("fedmix")
class FedMix(NaiveMix):
    """MAFL FedMix (Alg. 2): first-order approximation of global mixup from mean data."""

    Options = FedMixOptions
    #: its own opt-in: mix_loss differs from NaiveMix's, so batched_mix_loss must too
    batchable = True

    def setup(self):
        super().setup()
        if has_batchnorm(self.model):
            # l3 is linear in dL/dx; BatchNorm lets the weights before it scale that gradient
            # up without changing any output, so l3 is unbounded below (the paper drops BN)
            msg = (f"FedMix with a BatchNorm model can diverge: Eq. 5's l3 term is unbounded below when "
                   f"BatchNorm lets the input gradient grow. On digits over 500 rounds (benchmarks/RESULTS.md, "
                   f"3 seeds) --lam 0.05 trained but slid from 99% at its best to 97-98% at the end, where the "
                   f"model without BatchNorm still gained; --lam 0.2 fell to chance by round 100 (without "
                   f"BatchNorm to 10-28%, also at lr 0.01); 0.5 gave a NaN loss by round 2. The paper's models have "
                   f"no BatchNorm; use one without (e.g. --model-opt norm=none where the model has it) or a "
                   f"small --lam (now {self.options.lam:g})")
            self.warn(msg)

    def mix_loss(self, f, x, y, xbar, ybar, lam):
        return fedmix_loss(f, x, y, xbar, ybar, lam)

    def batched_mix_loss(self, forward, x, y, xbar, ybar, lam, weight):
        return batched_fedmix_loss(forward, x, y, xbar, ybar, lam, weight)
