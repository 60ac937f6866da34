"""World.send_objects over however many ranks launched it (mpiexec -n K).

Usage: python tests/send_objects_probe.py OUT_DIR
Rank r sends rank d a parcel naming both (and a tensor of r * 10 + d values, so parcels differ
in size) when (r + d) is odd, and nothing otherwise (rank 0 sends to no one); twice, so that a
second exchange between the same ranks cannot take the first one's bytes; in the second, rank 1
also addresses one to itself. Each rank writes
OUT_DIR/rank<r>.pt with what it received.
"""

import torch


def parcels(rank, size, round_):
    """Rank 1 also sends itself one in the second exchange."""
    return {d: {"from": rank, "to": d, "round": round_, "values": torch.arange(rank * 10 + d, dtype=torch.float64)}
            for d in range(size) if rank != 0 and ((rank + d) % 2 == 1 or (rank == d == 1 and round_ == 1))}


def exchanges(world):
    return {"size": world.size, "got": [world.send_objects(parcels(world.rank, world.size, k)) for k in range(2)]}


if __name__ == "__main__":
    import rank_probe

    rank_probe.run(exchanges)
