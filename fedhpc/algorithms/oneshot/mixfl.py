"""MixFL (XOR Mixup paper, the ablation baseline): one-shot FL with vanilla-mixup uploads, no decoding.

Devices encode as in XorMixFL but by mixup instead of XOR: floor(lam * b(target) +
(1 - lam) / D * sum of the D dummy blends) with the soft label lam on the target and
(1 - lam) / D on each dummy (authors' code: a fixed 0.5 pixel mix, 0.5/0.5 label). The
server adds the mixed samples as they arrive, soft-labelled, until its target labels
are balanced (counted by target label) and trains on its base set (one-hot labels)
plus them. The uploads are linear mixes of raw samples: the audit flags that
(``upload_linear_mix`` = 1), the weaker privacy of the paper's Table 3.
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
    mix_lam: float = field(default=0.5, metadata={
        "help": "mixup ratio on the target blend (authors: 0.5); the dummies share 1 - lam"})

    def validate(self):
        super().validate()
        if not 0 < self.mix_lam <= 1:
            raise ConfigError(f"--mix-lam must be in (0, 1], got {self.mix_lam}")


@register_algorithm("mixfl")
class MixFL(EncodedUploads):
    """One-shot: mixup-encoded uploads with soft labels, added without decoding."""

    Options = MixFLOptions
    kind = "mix"
    linear_mix = True

    def base_targets(self):
        return F.one_hot(self.server_y, self.num_classes).to(torch.float32)

    def augmented_set(self, rnd):
        enc, deficits = self.collect(rnd)
        kept = keep_until_balanced(enc.target, deficits)
        self.metrics["decoded_added"] = float(len(kept))
        self.measure_privacy(enc, enc.x[kept], kept)
        return from_pixels(enc.x[kept], self.server_x.dtype), enc.soft[kept].to(torch.float32), enc.target[kept]
