"""Print the cartesian product of launcher flags, one task per line, for slurm/sweep.sbatch.

    python slurm/make_sweep.py --algo fedavg fedprox fedmix --seed 0 1 2 > sweep.txt
"""

import itertools
import shlex
import sys


def main(argv):
    axes, key = [], None
    for tok in argv:
        if tok.startswith("--"):
            key = tok
            axes.append((key, []))
        elif key is None:
            sys.exit(f"error: value {tok!r} before any --flag; write e.g. --seed 0 1 2")
        else:
            axes[-1][1].append(tok)
    empty = [k for k, v in axes if not v]
    if empty:
        sys.exit(f"error: {empty} have no values; give at least one value after each flag")
    for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in axes]):
        print(" ".join(f"{k} {shlex.quote(v)}" for k, v in combo))


if __name__ == "__main__":
    main(sys.argv[1:])
