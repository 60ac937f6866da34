"""What a fresh process pays before its first round: the embedded digits, and a whole short launch.

Every launch, every rank of it and every subprocess of the test suite is a fresh Python
process, so start-up is paid many times over. Two ways to read the embedded digits are timed
in ONE invocation, each in fresh processes, interleaved, median of ``--repeats``:

* ``numpy``: what fedhpc does since a23bd02, reading scikit-learn's bundled
  ``datasets/data/digits.csv.gz`` with ``np.loadtxt`` (``fedhpc.data.digits.bundled_digits_csv``);
* ``sklearn``: ``sklearn.datasets.load_digits``, which imports scipy.stats and most of
  scikit-learn first (the fallback, forced here by making ``bundled_digits_csv`` return None).

Two measurements of each: the data alone (``import numpy, fedhpc.data.digits`` and the arrays),
and a one-round FedAvg launch on 1 thread (``python -m fedhpc.launch --algo fedavg --rounds 1``,
no outputs), whose remaining start-up is torch and the ``torch._dynamo`` import the first
optimizer triggers.

Usage:  python benchmarks/bench_startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FORCE_SKLEARN = "import fedhpc.data.digits as d; d.bundled_digits_csv = lambda: None; "
DATA = "from fedhpc.data.digits import load_digits_arrays; load_digits_arrays()"
LAUNCH = ("from fedhpc.launch import main; main(['--algo', 'fedavg', '--rounds', '1', '--threads', '1', "
          "'--quiet', '--no-tensorboard', '--no-out'])")


def timed(code: str) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cases = {("data", "numpy"): DATA, ("data", "sklearn"): FORCE_SKLEARN + DATA,
             ("launch", "numpy"): LAUNCH, ("launch", "sklearn"): FORCE_SKLEARN + LAUNCH}
    times = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so load changes hit every case alike
        for k, code in cases.items():
            times[k].append(timed(code))
    print("| what | numpy read (s) | sklearn.datasets (s) | sklearn / numpy |")
    print("|---|---:|---:|---:|")
    for what in ("data", "launch"):
        fast, slow = statistics.median(times[(what, "numpy")]), statistics.median(times[(what, "sklearn")])
        print(f"| {what} | {fast:.2f} | {slow:.2f} | {slow / fast:.2f}x |")


if __name__ == "__main__":
    main()
