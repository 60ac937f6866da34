"""MixFLD (Mix2FLD paper Sec. III-B, Eq. 6): FLD whose seeds are mixups, so no raw sample leaves a device.

Each device uploads N_S seeds, each mixing N = 2 of its samples of *different* labels
with ratio lambda in (0, 0.5) (the first sample gets lambda) and the soft label
(lambda, 1 - lambda) on their labels (:func:`fedhpc.exchanges.seed_samples.mixed_seeds`).
The server converts outputs into a model on these soft-labelled seeds exactly as FLD
does; each seed distils from the same mixture of the two labels' global outputs.

Label pairs (``--seed-pairing``, :mod:`fedhpc.exchanges.seed_samples`): by default every device
uses the same pair in each seed slot, rotated by its id, so that Mix2FLD's server finds mirrored
partners on other devices, and the slots' pairs run through every label in turn (``balanced``),
so that the server's seeds hold every label evenly. ``shared``, the schedule before it, drew each
slot's pair on its own and could leave labels out (N_S = 10, run seed 0: three of ten); a run
started under it (every checkpoint that does not record the pairing) resumes under it, which is
what ``auto``, the option's default, resolves to for it. ``random`` reads Eq. 6 literally.
"""

from __future__ import annotations

import torch

from ...errors import CheckpointError
from ...exchanges.seed_samples import SeedSet, mixed_seeds, resolve_pairing
from .. import register_algorithm
from ..base import derive_seed
from .fld import FLD


@register_algorithm("mixfld")
class MixFLD(FLD):
    """FLD with mixed-up seed samples (privacy-preserving uplink)."""

    seed_kind = "mixed"

    def setup(self):
        super().setup()
        #: the label schedule the seeds are made with: --seed-pairing, 'auto' resolved (a resume
        #: may change it to what its checkpoint ran with, before the seeds are made)
        self.seed_pairing = resolve_pairing(self.options.seed_pairing)

    def make_seeds(self, cid: int) -> SeedSet:
        o = self.options
        x, y = self.device_inputs(cid)
        g = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "seed-samples", cid))
        return mixed_seeds(x, y, o.seeds_per_device, list(o.ratios()), self.num_classes, g, cid=cid,
                           pairing=self.seed_pairing, schedule_seed=self.cfg.seed)

    def state_dict(self):
        return {**super().state_dict(), "seed_pairing": self.seed_pairing}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        # Seeds are made once per run and remade by a resumed run (FLD.round_begin), so the
        # resume must make them under the schedule the checkpointed rounds trained on.
        # A checkpoint without the record ran 'shared' (the default then) or 'random' if asked: the
        # identity leaves the option out (checked_by_state), so an explicit value is checked here.
        saved = state.get("seed_pairing")
        try:
            self.seed_pairing = resolve_pairing(self.options.seed_pairing, saved, resumed_without_record=saved is None)
        except CheckpointError as e:
            raise CheckpointError(f"{self.cfg.algo}: {e}") from None
