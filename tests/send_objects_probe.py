"""World.send_objects over however many ranks launched it (mpiexec -n K).

Usage: python tests/send_objects_probe.py OUT_DIR
Rank r sends rank d a parcel naming both (and a tensor of r * 10 + d values, so parcels differ
in size) when (r + d) is odd, and nothing otherwise (rank 0 sends to no one); twice, so that a
second exchange between the same ranks cannot take the first one's bytes; in the second, rank 1
also addresses one to itself. Each rank writes
OUT_DIR/rank<r>.pt with what it received.
"""

import os
import sys

import torch

from fedhpc.world import World


def parcels(rank, size, round_):
    """Rank 1 also sends itself one in the second exchange."""
    return {d: {"from": rank, "to": d, "round": round_, "values": torch.arange(rank * 10 + d, dtype=torch.float64)}
            for d in range(size) if rank != 0 and ((rank + d) % 2 == 1 or (rank == d == 1 and round_ == 1))}


def main():
    out = sys.argv[1]
    world = World("cpu", threads=1)
    try:
        got = [world.send_objects(parcels(world.rank, world.size, k)) for k in range(2)]
        os.makedirs(out, exist_ok=True)
        torch.save({"size": world.size, "got": got}, os.path.join(out, f"rank{world.rank}.pt"))
    finally:
        world.close()


if __name__ == "__main__":
    from fedhpc.launch import exit_now

    main()
    exit_now(0)  # outputs are written: skip the teardown in which gloo sometimes aborts
