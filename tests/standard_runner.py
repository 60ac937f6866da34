"""Run several fedhpc configurations one after another in one process group.

The standard test set compares 1 and 2 ranks for every registered algorithm and two
models; launching ``mpiexec`` once for all of them (instead of once per case) keeps the
suite fast. Also imported in-process for the single-rank side, so both sides run the
same code.

    mpiexec -n 2 python tests/standard_runner.py CASES.json OUT_DIR

CASES.json: {"case name": [launcher flags...], ...}. For each case rank 0 writes
OUT_DIR/<case>.pt with the final global state, the final metrics and every client's
algorithm state (gathered from whichever rank holds it). A case given as
{"argv": [...], "interrupt_after": r} is stopped after round r as a SIGTERM would stop it
(checkpoint under OUT_DIR/<case>_run) and resumed with ``--resume`` on the same ranks.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def run_case(argv, world, interrupt_after=None):
    """Run one configuration to its end; returns (engine, final metrics, client states).

    ``interrupt_after=r`` stops the run after round r as a SIGTERM would (checkpoint,
    Preempted); the caller resumes it with ``--resume``.
    """
    import signal

    from fedhpc.config import parse_args
    from fedhpc.engine import Engine

    cfg, algo_opts, data_opts = parse_args(argv)
    eng = Engine(cfg, algo_opts, data_opts, world)
    if interrupt_after is not None:
        run_round = eng.run_round

        def run_round_then_signal(t):
            if t + 1 == interrupt_after:
                eng._stop_signal = signal.SIGTERM  # read when the round's buffer is filled
            return run_round(t)

        eng.run_round = run_round_then_signal
    final = eng.run()
    states = {}
    for part in world.all_gather_object({cid: s.get("algo") for cid, s in eng.client_state.items()}):
        states.update(part)
    return eng, final, states


def main():
    cases_path, out_dir = sys.argv[1], sys.argv[2]
    from fedhpc.world import World

    world = World(threads=1)
    try:
        from fedhpc.engine import Preempted

        for name, spec in json.load(open(cases_path)).items():
            if isinstance(spec, dict):  # interrupted, then resumed in the same process group
                argv = spec["argv"] + ["--out", os.path.join(out_dir, f"{name}_run")]
                try:
                    run_case(argv, world, interrupt_after=spec["interrupt_after"])
                    raise RuntimeError(f"{name}: the run was not interrupted")
                except Preempted:
                    pass
                eng, final, states = run_case(argv + ["--resume"], world)
            else:
                eng, final, states = run_case(spec, world)
            if world.rank == 0:
                torch.save({"global_state": eng.global_state.cpu(), "final": final, "states": states},
                           os.path.join(out_dir, f"{name}.pt"))
    finally:
        world.close()


if __name__ == "__main__":
    from fedhpc.launch import exit_now

    main()
    exit_now(0)  # outputs are written: skip the teardown in which gloo sometimes aborts
