"""checkpoint.save / load_latest_intact on real ranks (run under mpiexec by test_checkpoint.py).

Usage: python tests/checkpoint_probe.py OUT
Every rank writes OUT/result<rank>.json with what it saw in three cases:
``fallback``: rounds 10 and 20 saved collectively (a client-state shard per rank), then
round 20's server.pt corrupted; ``same``: each rank reads its own intact copy of the
checkpoints; ``divergent``: each rank reads its own copy and only rank 1's copy has the
corruption (ranks that do not share a disk).
"""

import json
import os
import shutil
import sys

import torch

from fedhpc import checkpoint
from fedhpc.client_state import ClientStateStore
from fedhpc.errors import CheckpointError
from fedhpc.world import World

IDENTITY = {"algo": "fedavg", "lr": 0.1, "seed": 3}


class ShardStore:
    """A client-state store holding one client per rank (client = rank), as save calls it."""

    def __init__(self, world):
        self.world = world

    def save_shard(self, directory):
        store = ClientStateStore(self.world, 1 << 20, directory + ".spill")
        store.put(self.world.rank, {"rank": torch.tensor(self.world.rank)})
        store.save_shard(directory)
        store.close()


def corrupt(path):
    blob = bytearray(open(path, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(path, "wb").write(bytes(blob))


def attempt(out, world):
    warnings = []
    try:
        directory, body = checkpoint.load_latest_intact(out, IDENTITY, warn=warnings.append, world=world)
        return {"directory": os.path.basename(directory), "round": body["round"], "warnings": warnings,
                "shards": [os.path.relpath(d, directory) for d in body["client_state_dirs"]]}
    except CheckpointError as e:
        return {"error": str(e), "warnings": warnings}


def main():
    out = sys.argv[1]
    world = World(threads=1)
    run = os.path.join(out, "run")
    for r in (10, 20):
        server = {"identity": IDENTITY, "global_state": torch.full((4,), float(r))}
        checkpoint.save(run, r, world, server, ShardStore(world))
    if world.rank == 0:
        for r in range(world.size):  # private copies per rank, before any damage
            shutil.copytree(run, os.path.join(out, f"same{r}"))
            shutil.copytree(run, os.path.join(out, f"view{r}"))
        for damaged in (run, os.path.join(out, "view1")):
            corrupt(os.path.join(checkpoint.checkpoint_root(damaged), "round_000020", "server.pt"))
    world.barrier()
    result = {"size": world.size, "fallback": attempt(run, world),
              "same": attempt(os.path.join(out, f"same{world.rank}"), world),
              "divergent": attempt(os.path.join(out, f"view{world.rank}"), world)}
    with open(os.path.join(out, f"result{world.rank}.json"), "w") as f:
        json.dump(result, f)
    world.close()


if __name__ == "__main__":
    from fedhpc.launch import exit_now

    main()
    exit_now(0)  # outputs are written: skip the teardown in which gloo sometimes aborts
