"""Mix2FLD (Mix2FLD paper Sec. III-C, Eqs. 7-8, Alg. 1): MixFLD whose server inversely mixes the seeds.

Devices upload mixed seeds as in MixFLD. The server combines N mixed seeds from N
*different* devices whose label tuples are rotations of each other (for N = 2: labels
(a, b) mixed with lambda on one device and (b, a) on another) with the inverse of the
circulant mixing matrix (Eq. 8; for N = 2, lambda_hat = lambda / (2 lambda - 1), negative
weights expected), so every result carries a *hard* label, and trains on N_I >= N_S such
samples per device instead of the soft-labelled seeds
(:func:`fedhpc.exchanges.inverse_mixup.inverse_mixup`). Seeds of one device are never
combined (that could restore a raw sample). Everything else is FLD's. With
``--seed-delivery channel`` only the devices whose round-1 upload arrived contribute
seeds: N_I per such device are asked for, and as many as their seeds allow are made.
"""

from __future__ import annotations

import torch

from ...exchanges.inverse_mixup import inverse_mixup
from ...exchanges.seed_samples import SeedSet
from .. import register_algorithm
from ..base import derive_seed
from .mixfld import MixFLD


@register_algorithm("mix2fld")
class Mix2FLD(MixFLD):
    """FLD with two-way mixup: mixed seeds up, inversely mixed hard-labelled samples on the server."""

    @classmethod
    def server_set_size(cls, options, devices: int) -> int:
        return options.inverse_per_device * devices  # N_I per device (auto K_s: fedhpc.config.auto)

    def server_samples(self, collected: SeedSet) -> SeedSet:
        o = self.options
        # N_I per device whose seeds reached the server: every training device with --seed-delivery always
        devices = len(self.training_clients) if o.seed_delivery == "always" else len(collected.owner.unique())
        n_out = o.inverse_per_device * devices
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "inverse-mixup"))
        # With --seed-delivery channel the devices present are the channel's draw, not a setting:
        # too few partners then give fewer samples (none at all: the conversion is skipped), where
        # with every device's seeds too few partners are a configuration error.
        return inverse_mixup(collected, n_out, N=len(o.ratios()), generator=g,
                             strict=o.seed_delivery == "always")
