"""FedAlt (Pillutla et al., ICML 2022; Singhal et al. 2021's reconstruction): alternating updates.

Shared layers u (averaged) and personal layers v_k (kept by the client). Each round the
client first updates v_k with u fixed, then u with v_k fixed, each phase with a fresh
optimiser (``--personal-epochs`` then ``--local-epochs`` epochs; the epoch counter runs on
through both phases, so the second phase sees new batch orders); it uploads u.

"Fixed" is truly fixed: the frozen layers get no gradient and their BatchNorm statistics
stay put (:func:`fedhpc.algorithms.personal.frozen`). The split is FedSim's default,
the first half of the layers shared (pMixFed Sec. 5.1). A cold-start client reconstructs its
personal layers from the global model (App. 10.1), u fixed, for ``--finetune-epochs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError
from .. import register_algorithm
from .fedsim import FedSim, FedSimOptions
from .base import frozen


@dataclass
class FedAltOptions(FedSimOptions):
    personal_epochs: int = field(default=0, metadata={
        "help": "epochs on the personal layers before the shared ones (0 = as many as --local-epochs)"})

    def validate(self):
        super().validate()
        if self.personal_epochs < 0:
            raise ConfigError(f"--personal-epochs must be >= 0 (0 = --local-epochs), got {self.personal_epochs}")


@register_algorithm("fedalt")
class FedAlt(FedSim):
    """FedAlt: personal layers updated first (shared fixed), then shared ones (personal fixed)."""

    Options = FedAltOptions
    #: its own opt-in (it overrides FedSim's local update): the batched path runs the same two
    #: phases, each a fresh stacked optimiser over the part not frozen (fedhpc.batched)
    batchable = True

    def personal_phase(self, model, ctx, epochs: int, first_epoch: int = 0) -> None:
        with frozen(self.shared_modules()):
            self.train_epochs(model, ctx, epochs, first_epoch=first_epoch)

    def local_update(self, model, ctx):
        pe = self.options.personal_epochs or self.cfg.local_epochs
        self.personal_phase(model, ctx, pe)
        with frozen(self.personal_modules()):
            self.train_epochs(model, ctx, self.cfg.local_epochs, first_epoch=pe)

    def batched_local_update(self, group):
        """``local_update``'s phases for K clients at once (fedhpc.batched.GroupTraining)."""
        pe = self.options.personal_epochs or self.cfg.local_epochs
        with frozen(self.shared_modules()):
            states = group.train(group.starts, epochs=pe)
        with frozen(self.personal_modules()):
            return group.train(states, epochs=self.cfg.local_epochs, first_epoch=pe)

    def adapt(self, model, ctx):
        self.personal_phase(model, ctx, self.options.finetune_epochs)
