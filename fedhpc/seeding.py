"""Seeds: every random choice of a run (sampling, partitions, initialisation, batch order, an
algorithm's draws) is keyed by the run's seed and names, never by the rank or the order of work,
so that a seed fixes the run on any number of ranks. The bottom layer: imports nothing of fedhpc.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch


def derive_seed(*keys: Any) -> int:
    """A 63-bit seed from integers and strings, stable across runs, ranks and platforms.

    A keyed BLAKE2b hash of the keys' canonical text (integers normalised, so a numpy
    integer and a Python int give the same seed). It runs several times per client per
    round, so it must be cheap: about 2 us, against 17-45 us for numpy's SeedSequence.
    """
    text = "\x1f".join(("s" + k) if isinstance(k, str) else str(int(k)) for k in keys)
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=b"fedhpc-seed").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_torch(seed: int, device: Optional[torch.device] = None) -> None:
    """Seed torch's default generator (and the CUDA one of ``device``) for dropout and the like.

    ``torch.manual_seed`` would also seed every lazy accelerator generator (and format a
    stack trace each time): ~170 us, paid per client per round. This costs ~1 us.
    """
    torch.default_generator.manual_seed(seed)
    if device is not None and device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)
