"""ReproducibleSum over however many ranks launched it (mpiexec -n K or one process).

Usage: python tests/reproducible_sum_probe.py OUT_DIR
Term t (adversarial: magnitudes from 2**-60 to 2**60, with cancellations) goes to rank
t % size; the ranks align, sum-all-reduce and write OUT_DIR/rank<r>.pt. Every file must
hold the single-process bits, which a plain float64 sum in rank order does not.
"""

import torch

from fedhpc.reproducible_sum import ReproducibleSum

TERMS, WIDTH = 12, 4000


def terms():
    g = torch.Generator().manual_seed(5)
    scale = torch.exp2(torch.randint(-60, 61, (TERMS, WIDTH), generator=g).double())
    t = torch.randn(TERMS, WIDTH, generator=g, dtype=torch.float64) * scale
    t[:, 0] = torch.tensor([2.0 ** 60, 3.0, -2.0 ** 60] + [0.0] * (TERMS - 3), dtype=torch.float64)
    return t


def summed(world):
    t = terms()
    acc = ReproducibleSum(WIDTH, TERMS)
    plain = torch.zeros(WIDTH, dtype=torch.float64)
    for i in range(world.rank, TERMS, world.size):
        acc.add_(t[i])
        plain += t[i]
    acc.align_(world)
    world.all_reduce_sum_(acc.data)
    world.all_reduce_sum_(plain)
    return {"size": world.size, "sum": acc.sum(), "plain": plain}


if __name__ == "__main__":
    import rank_probe

    rank_probe.run(summed)
