"""Rounds per second of the same FedAvg job on 1 and 2 ranks (mpiexec), in one script run.

Each configuration is a real launcher run; rounds/s = 1 / median(round_seconds)
over the rounds after a warm-up (round_seconds excludes evaluation). The three
configurations are run --repeats times, interleaved, and the median run is
reported, because a shared 2-core machine is noisy.

    python benchmarks/bench_ranks.py [--rounds 30] [--repeats 3] [--clients-per-round 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def run(ranks, threads, args, tmp, rep):
    out = os.path.join(tmp, f"r{ranks}t{threads}-{rep}")
    cmd = [sys.executable, "-m", "fedhpc.launch", *args, "--out", out, "--threads", str(threads)]
    if ranks > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks)] + cmd
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    secs = [json.loads(l)["round_seconds"] for l in open(os.path.join(out, "metrics.jsonl"))]
    return 1.0 / statistics.median(secs[2:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-clients", type=int, default=100)
    ap.add_argument("--clients-per-round", type=int, default=20)
    ap.add_argument("--local-epochs", type=int, default=2)
    a = ap.parse_args()
    args = ["--model", "cnn", "--num-clients", str(a.num_clients), "--clients-per-round", str(a.clients_per_round),
            "--local-epochs", str(a.local_epochs), "--rounds", str(a.rounds), "--eval-every", "1",
            "--quiet", "--no-tensorboard", "--checkpoint-every", "0"]
    cores = len(os.sched_getaffinity(0))
    tmp = tempfile.mkdtemp(prefix="fedhpc-bench-")
    configs = [(1, 1), (1, cores), (2, max(1, cores // 2))]
    speeds = {c: [] for c in configs}
    try:
        for rep in range(a.repeats):
            for ranks, threads in configs:
                speeds[(ranks, threads)].append(run(ranks, threads, args, tmp, rep))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    one_t1, one_all, two = (statistics.median(speeds[c]) for c in configs)
    for c in configs:
        print(f"runs of {c[0]} rank(s) x {c[1]} thread(s): " + ", ".join(f"{v:.2f}" for v in speeds[c]))
    print(f"config: digits, cnn, {a.clients_per_round} of {a.num_clients} clients per round, "
          f"{a.local_epochs} local epochs, {cores} cores")
    print(f"1 rank x 1 thread        : {one_t1:6.2f} rounds/s")
    print(f"1 rank x {cores} threads       : {one_all:6.2f} rounds/s")
    print(f"2 ranks x {max(1, cores // 2)} thread(s)     : {two:6.2f} rounds/s")
    print(f"speed-up 2 ranks over 1 rank x 1 thread : {two / one_t1:.2f}x (target >= 1.7x)")
    print(f"speed-up 2 ranks over 1 rank x {cores} threads: {two / one_all:.2f}x")


if __name__ == "__main__":
    main()
