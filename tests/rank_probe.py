"""The shell of the tests' multi-rank probes (``python tests/<name>_probe.py OUT_DIR`` under
``mpiexec -n K`` or alone): open a CPU world, compute this rank's result, write it to
``OUT_DIR/rank<r>.pt``, close the world, and exit without the teardown in which gloo sometimes
aborts once the outputs are written."""

import os
import sys
from typing import Any, Callable

from fedhpc.io import atomic_torch_save
from fedhpc.world import World


def run(compute: Callable[[World], Any]) -> None:
    """``compute(world)``'s result written as OUT_DIR (``sys.argv[1]``)/rank<r>.pt; then exit 0."""
    from fedhpc.launch import exit_now

    out = sys.argv[1]
    world = World("cpu", threads=1)
    try:
        result = compute(world)
        os.makedirs(out, exist_ok=True)
        atomic_torch_save(result, os.path.join(out, f"rank{world.rank}.pt"))
    finally:
        world.close()
    exit_now(0)
