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
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    #: why --clients-at-once > 1 is refused (fedhpc.batched.check_batchable)
    not_batchable_because = (
        "each client drops whole residual blocks for a batch at a time, and a dropped block's parameters "
        "take no step at all (no gradient: torch's SGD skips them, no weight decay, no momentum) and its "
        "BatchNorm statistics stay as they are, which one stacked forward and optimiser step over all "
        "clients' parameters cannot reproduce")

    def setup(self):
        super().setup()
        require_resnet(self, "set_stochastic_depth", "set_depth_generator")

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
