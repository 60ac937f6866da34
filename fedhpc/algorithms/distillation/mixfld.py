"""MixFLD (Mix2FLD paper Sec. III-B, Eq. 6): FLD whose seeds are mixups, so no raw sample leaves a device.

Each device uploads N_S seeds, each mixing N = 2 of its samples of *different* labels
with ratio lambda in (0, 0.5) (the first sample gets lambda) and the soft label
(lambda, 1 - lambda) on their labels (:func:`fedhpc.exchanges.seed_samples.mixed_seeds`).
The server converts outputs into a model on these soft-labelled seeds exactly as FLD
does; each seed distils from the same mixture of the two labels' global outputs.
Label pairs follow a shared seeded schedule (``--seed-pairing shared``) so that Mix2FLD's
server finds symmetric partners; ``random`` reads Eq. 6 literally.
"""

from __future__ import annotations

import torch

from ...exchanges.seed_samples import SeedSet, mixed_seeds
from .. import register_algorithm
from ..base import derive_seed
from .fld import FLD


@register_algorithm("mixfld")
class MixFLD(FLD):
    """FLD with mixed-up seed samples (privacy-preserving uplink)."""

    seed_kind = "mixed"

    def make_seeds(self, cid: int) -> SeedSet:
        o = self.options
        x, y = self.device_inputs(cid)
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "seed-samples", cid))
        return mixed_seeds(x, y, o.seeds_per_device, list(o.ratios()), self.num_classes, g, cid=cid,
                           pairing=o.seed_pairing, schedule_seed=self.cfg.seed)
