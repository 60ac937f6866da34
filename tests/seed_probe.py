"""Seed-sample collection and inverse mixup on however many ranks launched it (mpiexec -n K or one process).

Usage: python tests/seed_probe.py OUT_DIR
Rank r makes the seed sets of the devices cid with cid % size == r (synthetic data,
seeded by device id only), collects them, inverse-mixes them, and writes
OUT_DIR/rank<r>.pt; every rank's file must equal the single-process one.
"""

import torch

from fedhpc.algorithms.base import derive_seed
from fedhpc.exchanges.inverse_mixup import inverse_mixup
from fedhpc.exchanges.seed_samples import collect_seeds, mixed_seeds, raw_seeds

DEVICES, CLASSES, PER_DEVICE = 7, 6, 40


def device_data(cid):
    g = torch.Generator().manual_seed(derive_seed(11, "probe-data", cid))
    return torch.rand(PER_DEVICE, 1, 5, 5, generator=g), torch.randint(0, CLASSES, (PER_DEVICE,), generator=g)


def collected(world):
    mixed, raw, mixed3 = {}, {}, {}
    for cid in range(world.rank, DEVICES, world.size):
        x, y = device_data(cid)
        g = lambda tag: torch.Generator().manual_seed(derive_seed(11, tag, cid))
        mixed[cid] = mixed_seeds(x, y, 6, 0.2, CLASSES, g("mix"), cid=cid, schedule_seed=11)
        mixed3[cid] = mixed_seeds(x, y, 6, (0.1, 0.3, 0.6), CLASSES, g("mix3"), cid=cid, schedule_seed=11)
        raw[cid] = raw_seeds(x, y, 4, g("raw"), cid=cid, num_classes=CLASSES)
    got = {}
    for name, local in (("mixed", mixed), ("mixed3", mixed3), ("raw", raw)):
        col = collect_seeds(world, local)
        got[name] = {k: v for k, v in vars(col).items() if isinstance(v, torch.Tensor)}
    g = torch.Generator().manual_seed(derive_seed(11, "inverse-mixup"))
    inv = inverse_mixup(collect_seeds(world, mixed), 2 * 6 * DEVICES, 2, g)
    got["inverse"] = {k: v for k, v in vars(inv).items() if isinstance(v, torch.Tensor)}
    return {"size": world.size, "sets": got}


if __name__ == "__main__":
    import rank_probe

    rank_probe.run(collected)
