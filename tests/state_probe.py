"""A test-only algorithm that keeps per-client state, run as a script (also under mpiexec).

Usage: python tests/state_probe.py DUMP_DIR [launcher flags...]
Each rank writes the states it holds at the end to DUMP_DIR/rank<r>.pt.
"""

import os
import sys

import torch

from fedhpc.algorithms import register_algorithm
from fedhpc.algorithms.fedavg import FedAvg


@register_algorithm("state_probe")
class StateProbe(FedAvg):
    """FedAvg that counts, per client, the rounds it was trained in (in its client state)."""

    uses_client_state = True

    def local_update(self, model, ctx):
        super().local_update(model, ctx)
        state = ctx.load_state({"rounds": [], "vec": torch.zeros(2000)})
        state["rounds"].append(ctx.round.index)
        state["vec"] += ctx.cid + 1  # 8 KB per client: forces spills under a tiny budget
        ctx.save_state(state)


def main():
    dump, argv = sys.argv[1], sys.argv[2:]
    from fedhpc.config import parse_args
    from fedhpc.engine import Engine
    from fedhpc.world import World

    cfg, ao, do = parse_args(["--algo", "state_probe", *argv])
    world = World(cfg.device, cfg.threads)
    try:
        eng = Engine(cfg, ao, do, world)
        close = eng.client_state.close
        eng.client_state.close = lambda: None  # keep the spilled states readable for the dump
        eng.run()
        os.makedirs(dump, exist_ok=True)
        torch.save({"states": {c: s["algo"] for c, s in eng.client_state.items()}, "spills": eng.client_state.spills},
                   os.path.join(dump, f"rank{world.rank}.pt"))
        close()
    finally:
        world.close()


if __name__ == "__main__":
    from fedhpc.launch import exit_now

    main()
    exit_now(0)  # outputs are written: skip the teardown in which gloo sometimes aborts
