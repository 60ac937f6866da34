"""Evaluation on every client's local test split at 2,500 .. 20,000 clients: what does a sample cost?

Every eval round, the engine reports each client's model (the global one, or its own under a
personal method) on the client's own test split, over all clients, not only the round's. With
thousands of clients holding a few test samples each, that is thousands of tiny forwards unless
the global model's part runs over the splits laid end to end in eval batches (which it does since
9a3687b; a personal method's own models still run one client at a time, on the rank holding them).

Two cases, fedavg both: ``global`` (no client has a model of its own) and ``own`` (every client
has one: ``client_model`` hands each client a copy of the global model, the state a personal
method reaches once every client has trained; after one round only the round's 10 would).

Measured in ONE invocation, each a fresh process on 1 rank, 1 thread: the engine is built, one
round run, then ``_evaluate_local`` timed (best of 3) and divided by its number of local test
samples; beside it the global test set's evaluation per sample (``_evaluate_global``: the same
model, batches of --eval-batch-size, the floor a sample can cost). The ratio local / global per
sample is the overhead of evaluating clients (1 = none; a forward per client gives about the
eval batch over the client's test samples). ``--baseline DIR`` runs another checkout the same way.
Data: ``--dataset synthetic`` at 1x8x8, 10 samples per client (2 of them its test split), iid,
the digits CNN.

Usage:  python benchmarks/bench_local_eval.py [--clients 2500 20000] [--cases global own] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TIMED = r"""
import json, sys, time, torch
from fedhpc.config import parse_args
from fedhpc.engine import Engine
from fedhpc.world import World
case, clients = sys.argv[1], int(sys.argv[2])
cfg, ao, do = parse_args(["--algo", "fedavg", "--dataset", "synthetic", "--data-opt", "shape=1x8x8",
                          "--data-opt", f"train_samples={10 * clients}", "--num-clients", str(clients),
                          "--clients-per-round", "10", "--rounds", "1", "--partition", "iid", "--model", "cnn",
                          "--threads", "1", "--quiet", "--no-tensorboard"])
eng = Engine(cfg, ao, do, World(threads=1))
eng.run_round(0)
if case == "own":
    eng.algo.client_model = lambda cid: eng.global_state.clone()
def best(fn):
    times = []
    for _ in range(3):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)
with torch.no_grad():
    local = best(eng._evaluate_local)
    glob = best(lambda: eng._evaluate_global(eng.global_state))
samples = sum(int(eng.data.client_test_split(c)[1].numel()) for c in eng.training_clients)
print(json.dumps({"local": local, "global": glob, "local_samples": samples, "global_samples": eng.data.num_test()}))
"""


def measure(case: str, clients: int, repo: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", TIMED, case, str(clients)], cwd=repo, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo})
    if proc.returncode != 0:
        raise RuntimeError(f"{case} at {clients} clients failed in {repo}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[2500, 20000])
    parser.add_argument("--cases", nargs="+", default=["global", "own"], choices=["global", "own"])
    parser.add_argument("--baseline", metavar="DIR", help="also run this checkout of fedhpc (a `git worktree`)")
    args = parser.parse_args()
    checkouts = [("", REPO)] + ([(" (baseline)", os.path.abspath(args.baseline))] if args.baseline else [])
    print("| client models | clients | local eval | per local sample | per global-test sample | local / global |")
    print("|---|---:|---:|---:|---:|---:|")
    for case in args.cases:
        for clients in args.clients:
            for label, repo in checkouts:
                m = measure(case, clients, repo)
                per_local, per_global = m["local"] / m["local_samples"], m["global"] / m["global_samples"]
                print(f"| {case}{label} | {clients:,} | {m['local']:.2f} s | {per_local * 1e6:.1f} us | "
                      f"{per_global * 1e6:.1f} us | {per_local / per_global:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
