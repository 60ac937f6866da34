"""MixFL (XOR Mixup paper, the ablation baseline): one-shot FL with vanilla-mixup uploads, no decoding.

Devices encode as in XorMixFL but by mixup instead of XOR: floor(alpha * b(target) +
(1 - alpha) / D * sum of the D dummy blends) with the soft label alpha on the target and
(1 - alpha) / D on each dummy. The server adds the mixed samples as they arrive, soft-labelled,
until its target labels are balanced (counted by target label) and trains on its base set
(one-hot labels) plus them. The uploads are linear mixes of raw samples: the audit flags that
(``upload_linear_mix`` = 1), the weaker privacy of the paper's Table 3.

The mixup ratio is Table 4's alpha (``--blend-alpha``) unless ``--mix-lam`` sets another: the
paper has one "blending ratio" alpha for both members, and for MixFL it must reach the mix of
target and dummies, for at M = 1 (no same-label blend) Table 4's MixFL target-label accuracy
still moves with alpha (3 dummies: 19.78% at alpha 0.25, 46.46% at 0.95, "an increase of about
134%", Sec. 4.3), upwards, so alpha weighs the target; and Sec. 4.2 picks alpha = 0.5 for MixFL
because "equal blending" of the two raw samples leaks least. The authors' code: a fixed 0.5
pixel mix with a 0.5/0.5 label, alpha's default. Before this reading the ratio was --mix-lam's
own default 0.5 whatever alpha was, so Table 4's M = 1 MixFL cells were one run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from .. import register_algorithm
from .base import EncodedUploads, EncodingOptions, keep_until_balanced
from .sample_codecs import from_pixels


@dataclass
class MixFLOptions(EncodingOptions):
    mix_lam: float = field(default=0.0, metadata={
        "help": "mixup ratio on the target blend, the dummies sharing 1 - lam; 0 (default) = --blend-alpha "
                "(Table 4's alpha; authors 0.5)"})

    def ratio(self) -> float:
        return float(self.mix_lam if self.mix_lam else self.blend_alpha)

    def validate(self):
        super().validate()
        if not 0 <= self.mix_lam <= 1:
            raise ConfigError(f"--mix-lam must be in (0, 1], or 0 for --blend-alpha, got {self.mix_lam}")
        if not 0 < self.ratio() <= 1:
            raise ConfigError(f"--blend-alpha is MixFL's mixup ratio on the target unless --mix-lam sets one, and "
                              f"must then be in (0, 1], got {self.blend_alpha}")

    def inert_options(self):
        # alpha is the mixup ratio unless --mix-lam sets one: then, at M = 1, it blends nothing
        inert = super().inert_options()
        return inert if self.mix_lam else tuple(o for o in inert if o != "blend_alpha")


@register_algorithm("mixfl")
class MixFL(EncodedUploads):
    """One-shot: mixup-encoded uploads with soft labels, added without decoding."""

    Options = MixFLOptions
    kind = "mix"
    linear_mix = True

    def mix_ratio(self) -> float:
        return self.options.ratio()

    def base_targets(self):
        return F.one_hot(self.server_y, self.num_classes).to(torch.float32)

    def augmented_set(self, rnd):
        enc, deficits = self.collect(rnd)
        kept = keep_until_balanced(enc.target, deficits)
        self.metrics["decoded_added"] = float(len(kept))
        self.measure_privacy(enc, enc.x[kept], kept)
        return from_pixels(enc.x[kept], self.server_x.dtype), enc.soft[kept].to(torch.float32), enc.target[kept]
