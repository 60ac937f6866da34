"""One-off up-front exchanges at 2,500 .. 20,000 clients: does the cost per client stay flat?

Mix2FLD's, MixFLD's and FLD's first round makes every device's seed samples, gathers them,
books each device's bytes and measures the seeds' privacy against their raw sources. Work that
is linear in the devices costs the same per device at any scale; a loop over devices that scans
all the gathered samples (what this benchmark was written to catch: Mix2FLD took 144 s at
20,000 devices, 46 s at 10,000) makes the cost per device grow with the number of devices.

Measured in ONE invocation, each run a fresh launcher process on 1 rank (``--ranks``), 1 thread:
round 1's ``round_seconds`` (from metrics.jsonl) / number of devices (10 of them train), for
each size, and the ratio largest / smallest size (target about 1; a quadratic loop gives the
size ratio, 8). Data: ``--dataset synthetic`` at 1x8x8 with 10 samples per device, iid, 4 seeds
per device. (XorMixFL's encoded uploads need pixels, which the synthetic data are not, and the
digits hold too few samples for thousands of devices: not measured here.) Also the time for
``dirichlet_capped`` to refuse a split it cannot make at the largest size (1,000 draws).

Usage:  python benchmarks/bench_client_scale.py [--clients 2500 5000 10000 20000] [--algos mix2fld fld]
            [--ranks 2] [--baseline DIR] [--skip-refusal]
DIR: another checkout run in the same invocation, e.g. `git worktree add DIR 3eeee08` (before the fix).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALGO_FLAGS = {
    "mix2fld": ["--model", "mlp", "--server-steps", "20", "--seeds-per-device", "4"],
    "mixfld": ["--model", "mlp", "--server-steps", "20", "--seeds-per-device", "4"],
    "fld": ["--model", "mlp", "--server-steps", "20", "--seeds-per-device", "4"],
}


def round_one_seconds(algo: str, clients: int, out: str, repo: str = REPO, ranks: int = 1) -> float:
    flags = ALGO_FLAGS[algo]
    data = ["--dataset", "synthetic", "--data-opt", "shape=1x8x8", "--data-opt", f"train_samples={10 * clients}"]
    mpiexec = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks)] if ranks > 1 else []
    cmd = [*mpiexec, sys.executable, "-m", "fedhpc.launch", "--algo", algo, *flags, *data, "--num-clients", str(clients),
           "--clients-per-round", "10", "--rounds", "1", "--partition", "iid", "--threads", "1", "--quiet",
           "--no-tensorboard", "--out", out]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{algo} at {clients} clients failed:\n{proc.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        first = json.loads(f.readline())
    shutil.rmtree(out)
    return first["round_seconds"]


CAPPED_REFUSAL = """
import sys, time
import numpy as np
from fedhpc.data.partition import make_partition
from fedhpc.errors import ConfigError
clients = int(sys.argv[1])
labels = np.random.default_rng(0).integers(0, 10, 11 * clients)
t0 = time.perf_counter()
try:
    make_partition("dirichlet_capped:0.5", labels, clients, 0)
except ConfigError:
    print(time.perf_counter() - t0)
"""


def capped_refusal_seconds(clients: int, repo: str = REPO) -> float:
    """Seconds for dirichlet_capped:0.5 (MIN 10) to refuse ``clients`` clients of 11 samples."""
    proc = subprocess.run([sys.executable, "-c", CAPPED_REFUSAL, str(clients)], cwd=repo, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"dirichlet_capped:0.5 was expected to refuse {clients} clients:\n{proc.stderr[-2000:]}")
    return float(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[2500, 5000, 10000, 20000])
    parser.add_argument("--algos", nargs="*", default=["mix2fld", "mixfld", "fld"],
                        help="none: only the dirichlet_capped refusal")
    parser.add_argument("--skip-refusal", action="store_true", help="leave out the dirichlet_capped refusal")
    parser.add_argument("--ranks", type=int, default=1, help="MPI ranks per run (mpiexec from the venv)")
    parser.add_argument("--baseline", metavar="DIR",
                        help="also run each algorithm from this checkout of fedhpc (e.g. a `git worktree` of an "
                             "older commit), in the same invocation, same interpreter")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="fedhpc-scale-")
    print("| algorithm | " + " | ".join(f"{c:,} clients" for c in args.clients) + " | largest / smallest |")
    print("|---|" + "---:|" * (len(args.clients) + 1))
    checkouts = [("", REPO)] + ([(" (baseline)", os.path.abspath(args.baseline))] if args.baseline else [])
    for _, repo in checkouts if args.algos else []:
        # untimed: a checkout's first run may build the native ops or write its .pyc files
        round_one_seconds(args.algos[0], 100, os.path.join(tmp, "warm-up"), repo, args.ranks)
    for algo in args.algos:
        for label, repo in checkouts:
            per = [round_one_seconds(algo, c, os.path.join(tmp, f"{algo}-{c}"), repo, args.ranks) / c for c in args.clients]
            cells = " | ".join(f"{p * 1e3:.3f} ms" for p in per)
            print(f"| {algo}{label} | {cells} | {per[-1] / per[0]:.2f} |", flush=True)
    for label, repo in [] if args.skip_refusal else checkouts:
        print(f"\ndirichlet_capped:0.5 refusing {args.clients[-1]:,} clients of 11 samples (1,000 draws){label}: "
              f"{capped_refusal_seconds(args.clients[-1], repo):.1f} s", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
